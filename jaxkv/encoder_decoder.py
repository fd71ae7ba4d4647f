"""The cache of an encoder-decoder model: decoder self-attention plus cross-attention K/V.

A decoder layer of an encoder-decoder model (BART, T5, Whisper) attends twice: to the
tokens it generated (self-attention, which grows by one token per step and is an ordinary
``Cache`` of any kind: static, dynamic, sliding...) and to the encoder's output
(cross-attention). The cross-attention keys and values depend only on the encoder output,
so they are computed once per input, stored with ``with_cross_attention`` and afterwards
only read with ``cross_attention``; a decode step never writes them.

Model code, per decoder layer::

    cache, self_kv = cache.update(i, k, v, positions)   # the decoder's own tokens
    cross_kv = cache.cross_attention(i)                  # the encoder output, read only

Batch edits (``reorder``/``select``/``repeat``) gather rows in both halves, so beams keep
their own encoder rows; ``rollback`` (speculative decoding) only touches the decoder half,
since the encoder input does not change while decoding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import Cache
from jaxkv.protocol import KVView, MaskInfo, check_array, flat_group_indices, is_traced, pytree_class
from jaxkv.sizing import human_bytes


def bidirectional_view(key_stack: jax.Array, value_stack: jax.Array, index, positions: jax.Array) -> KVView:
    """A view in which every real query sees every real slot: no causal order.

    ``key_stack``/``value_stack``: ``[L, B, H_kv, S, D]``, read at entry ``index``;
    ``positions``: ``[B, S]``, negative for padding slots. Encoder self-attention and
    cross-attention are not causal, while ``attention_mask`` admits a slot only at or
    before the query's position. Every real slot is therefore given position 0, which
    every real query (position >= 0) may see, and padding slots -1, which no query sees;
    a padding query (negative position) still sees nothing.
    """
    kv_positions = jnp.where(positions >= 0, 0, -1).astype(jnp.int32)
    return KVView(key_stack=key_stack, value_stack=value_stack, index=index, mask_info=MaskInfo(kv_positions))


@pytree_class
class EncoderDecoderCache:
    """Decoder self-attention ``Cache`` plus the cross-attention K/V of every decoder layer.

    ``cross_keys``/``cross_values``: ``[L, B, H_kv, S_enc, D]``, layer-major so a model
    scanning over its decoder layers reads entry i in place. ``encoder_positions``:
    ``[B, S_enc]`` int32, the position of each encoder token, -1 for padding (ragged
    encoder inputs) and for a cache whose cross half was not filled yet. Every method is
    pure and jittable except ``reserve`` (as ``Cache.reserve``).
    """

    self_attention: Cache
    cross_keys: jax.Array  # [L, B, H_kv, S_enc, D]
    cross_values: jax.Array  # [L, B, H_kv, S_enc, D]
    encoder_positions: jax.Array  # [B, S_enc] int32, -1: padding

    MEMORY_FORMULA = "2·B·S_enc·H_kv·D·bytes (+ 4·B·S_enc once per cache), fixed while decoding"

    @staticmethod
    def kv_bytes(batch_size, seq_len, num_kv_heads, head_dim, dtype, **_) -> int:
        """Cross-attention K/V bytes of one decoder layer for encoder inputs of ``seq_len``
        tokens; the cache adds ``4·B·S_enc`` once (``encoder_positions``) and its decoder
        half's own layers."""
        return 2 * batch_size * seq_len * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize

    @classmethod
    def create(
        cls, self_attention: Cache, *, encoder_length: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32
    ) -> EncoderDecoderCache:
        """An empty cross half next to ``self_attention``, one entry per decoder layer,
        for encoder inputs of up to ``encoder_length`` tokens (fixed, so one compiled
        decode step serves every input of that bucket)."""
        if encoder_length <= 0:
            raise ValueError(f"encoder_length must be positive, got {encoder_length}")
        batch = self_attention.batch_size
        shape = (len(self_attention.layer_types), batch, num_kv_heads, encoder_length, head_dim)
        return cls(
            self_attention,
            jnp.zeros(shape, dtype),
            jnp.zeros(shape, dtype),
            jnp.full((batch, encoder_length), -1, jnp.int32),
        )

    def with_cross_attention(self, keys: jax.Array, values: jax.Array, encoder_positions) -> EncoderDecoderCache:
        """Store the cross-attention K/V ``[L, B, H_kv, S_enc, D]`` computed from one
        encoder output, replacing any earlier one; ``encoder_positions`` ``[B, S_enc]``
        marks padding with negative values. Shapes and dtype must be the ones the cache
        was built with (checked at trace time)."""
        encoder_positions = jnp.asarray(encoder_positions)
        caller, layout = "EncoderDecoderCache.with_cross_attention", ("L", "B", "H_kv", "S_enc", "D")
        for what, x in (("keys", keys), ("values", values)):
            fix = f"; build it with encoder_length={x.shape[3] if x.ndim == 5 else '...'} or pad the encoder input"
            check_array(caller, what, x, layout, self.cross_keys.shape, self.cross_keys.dtype, fix)
        if encoder_positions.shape != self.encoder_positions.shape:
            raise ValueError(
                f"EncoderDecoderCache.with_cross_attention: encoder_positions has shape "
                f"{tuple(encoder_positions.shape)}, expected [B, S_enc] = {list(self.encoder_positions.shape)}"
            )
        if not jnp.issubdtype(encoder_positions.dtype, jnp.integer):
            raise TypeError(f"encoder_positions must be integers, got {encoder_positions.dtype}")
        return self.replace(cross_keys=keys, cross_values=values, encoder_positions=encoder_positions.astype(jnp.int32))

    # --- what model code calls ----------------------------------------------------
    def update(self, layer_idx, keys, values, positions=None) -> tuple[EncoderDecoderCache, KVView]:
        """Decoder self-attention: ``Cache.update`` of the decoder half."""
        self_attention, view = self.self_attention.update(layer_idx, keys, values, positions)
        return self.replace(self_attention=self_attention), view

    def cross_attention(self, layer_idx) -> KVView:
        """Decoder layer ``layer_idx``'s (int or traced scalar) cross-attention K/V
        ``[B, H_kv, S_enc, D]``; its mask admits exactly the non-padding encoder slots, to
        every real decoder query whatever its position."""
        return bidirectional_view(self.cross_keys, self.cross_values, layer_idx, self.encoder_positions)

    # --- lengths, capacity, footprint (the decoder half decides) ------------------
    @property
    def lengths(self) -> jax.Array:
        """``[B]`` int32: tokens each row's decoder has seen."""
        return self.self_attention.lengths

    @property
    def encoder_lengths(self) -> jax.Array:
        """``[B]`` int32: non-padding encoder tokens of each row."""
        return jnp.sum(self.encoder_positions >= 0, axis=1, dtype=jnp.int32)

    @property
    def batch_size(self) -> int:
        return self.self_attention.batch_size

    @property
    def layer_types(self) -> tuple[str, ...]:
        return self.self_attention.layer_types

    def next_positions(self, num_tokens: int, num_new=None) -> jax.Array:
        """Decoder positions ``[B, T]``, as ``Cache.next_positions``."""
        return self.self_attention.next_positions(num_tokens, num_new)

    @property
    def max_length(self) -> int | None:
        return self.self_attention.max_length

    @property
    def max_rollback(self) -> int | None:
        return self.self_attention.max_rollback

    @property
    def overflowed(self) -> jax.Array:
        return self.self_attention.overflowed

    @property
    def nbytes(self) -> int:
        """Both halves: the decoder's self-attention layers and the cross K/V."""
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self))

    def reserve(self, num_new_tokens: int) -> EncoderDecoderCache:
        """Grow the decoder's growing layers (outside jit); the cross half has a fixed size."""
        return self.replace(self_attention=self.self_attention.reserve(num_new_tokens))

    def grow(self, capacity: int) -> EncoderDecoderCache:
        return self.replace(self_attention=self.self_attention.grow(capacity))

    # --- batch and time edits -----------------------------------------------------
    def reorder(self, beam_indices) -> EncoderDecoderCache:
        """Row i of the result is row ``beam_indices[i]`` of this cache, in both halves."""
        indices = jnp.asarray(beam_indices, jnp.int32)
        self_attention = self.self_attention.reorder(indices)  # checks the indices
        return EncoderDecoderCache(
            self_attention,
            jnp.take(self.cross_keys, indices, axis=1),
            jnp.take(self.cross_values, indices, axis=1),
            jnp.take(self.encoder_positions, indices, axis=0),
        )

    select = reorder

    def reorder_in_groups(self, indices) -> EncoderDecoderCache:
        """Beams reordered within their input's group of ``K`` rows (``indices`` ``[G, K]``; see
        ``Cache.reorder_in_groups``), in both halves."""
        return self.reorder(flat_group_indices(jnp.asarray(indices, jnp.int32)))

    def repeat(self, num_repeats: int) -> EncoderDecoderCache:
        """Each row ``num_repeats`` times in a row, in both halves (one encoded input ->
        N beams or samples, without encoding it N times)."""
        if num_repeats <= 0:
            raise ValueError(f"num_repeats must be positive, got {num_repeats}")
        return self.reorder(jnp.repeat(jnp.arange(self.batch_size), num_repeats))

    def rollback(self, num_tokens) -> EncoderDecoderCache:
        """Forget the decoder's last ``num_tokens`` (as ``Cache.rollback``); the encoder
        input, and so the cross half, stays."""
        return self.replace(self_attention=self.self_attention.rollback(num_tokens))

    def reset(self) -> EncoderDecoderCache:
        """Empty both halves, keeping shapes: the next request brings a new encoder input."""
        return EncoderDecoderCache(
            self.self_attention.reset(),
            jnp.zeros_like(self.cross_keys),
            jnp.zeros_like(self.cross_values),
            jnp.full_like(self.encoder_positions, -1),
        )

    # --- display ------------------------------------------------------------------
    def __repr__(self) -> str:
        encoder = "traced" if is_traced(self.encoder_positions) else np.asarray(self.encoder_lengths).tolist()
        cross_bytes = self.cross_keys.nbytes + self.cross_values.nbytes + self.encoder_positions.nbytes
        num_layers, _, heads, slots, dim = self.cross_keys.shape
        cross = (
            f"cross-attention: {num_layers} layers [B, {heads}, {slots}, {dim}] {self.cross_keys.dtype}, "
            f"encoder lengths={encoder}, {human_bytes(cross_bytes)}"
        )
        return f"EncoderDecoderCache(\n{self.self_attention!r}\n{cross})"
