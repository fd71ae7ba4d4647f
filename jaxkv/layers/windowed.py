"""Attention that sees a bounded span, stored in a ring buffer of exactly that span.

``SlidingWindowLayer`` (Mistral, Gemma 3 local layers): a query at q sees keys in
``(q - W, q]``. ``ChunkedLayer`` (Llama 4): a query sees only the earlier keys of its own
chunk of C tokens. Either way no query ever needs more than the last W (or C) keys, so a
ring of that many slots suffices: slot ``p % N`` holds position ``p``.

Rollback: after undoing n tokens, the next query at position L - n needs the W - 1
positions before it, which a ring of W slots still holds only for n = 1. ``rollback_slots``
R adds R slots, so that undoing up to R + 1 tokens (speculative decoding) leaves every
needed key stored; the reference cannot roll a sliding window back past its window. The
R + 1 count from the furthest position the ring has held, so rollbacks without a feed in
between share them (``rollback_budget``): eagerly undoing more is an error naming the fix,
under jit the count is clamped (the container clamps every layer alike, so all stay in step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.protocol import BatchMajorLayer, HeldTokens, KVView, MaskInfo, Refill, Rollback, check_update_inputs
from jaxkv.protocol import KV_AXES, describe_extent, entry, lengths_after, ring_rollback_budget, visible_positions
from jaxkv.protocol import pytree_class, write_slots
from jaxkv.sharding import BATCH, KV_SLOTS, Axes


@pytree_class
class RingBufferLayer(BatchMajorLayer, Rollback, HeldTokens, Refill):
    """The ring shared by the windowed layers: ``[B, H_kv, span + R, D]``, slot ``p % (span + R)``
    holding position p. Subclasses name the span (``SPAN_NAME``, the ``MaskInfo`` field it sets)."""

    keys: jax.Array  # [B, H_kv, span + R, D]
    values: jax.Array  # [B, H_kv, span + R, D]
    slot_positions: jax.Array  # [B, span + R] int32, -1 = empty
    lengths: jax.Array  # [B] int32: tokens seen, not slots filled
    span: int = struct.field(pytree_node=False)
    rollback_slots: int = struct.field(pytree_node=False, default=0)

    SPAN_NAME = "span"

    @classmethod
    def create(cls, batch_size, num_kv_heads, head_dim, span, dtype=jnp.float32, rollback_slots=0):
        if span <= 0 or rollback_slots < 0:
            raise ValueError(
                f"{cls.__name__}: span must be positive and rollback_slots >= 0, got {span}, {rollback_slots}"
            )
        slots = span + rollback_slots
        shape = (batch_size, num_kv_heads, slots, head_dim)
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            slot_positions=jnp.full((batch_size, slots), -1, jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            span=span,
            rollback_slots=rollback_slots,
        )

    @classmethod
    def kv_bytes(cls, batch_size, seq_len, num_kv_heads, head_dim, dtype, span=None, rollback_slots=0, **_) -> int:
        """Bytes of the ring, whatever ``seq_len``: K/V, slot positions and lengths."""
        slots = span + rollback_slots
        kv = 2 * batch_size * slots * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
        return kv + 4 * batch_size * (slots + 1)

    @property
    def max_length(self) -> None:
        return None

    @property
    def max_rollback(self) -> int:
        return self.rollback_slots + 1

    @property
    def rollback_budget(self) -> jax.Array:
        return ring_rollback_budget(self.slot_positions, self.lengths, self.max_rollback)

    def describe(self) -> str:
        return describe_extent(self.rollback_slots, **{self.SPAN_NAME: self.span})

    def held_entry(self, index):
        """The ring's tokens sorted by position (empty slots last)."""
        positions = entry(self.slot_positions, index)  # [B, S]
        order = jnp.argsort(jnp.where(positions < 0, jnp.iinfo(jnp.int32).max, positions), axis=-1)
        take = lambda x: jnp.take_along_axis(entry(x, index), order[:, None, :, None], axis=2)  # noqa: E731
        return take(self.keys), take(self.values), jnp.take_along_axis(positions, order, axis=-1)

    def logical_axes(self):
        return self.replace(keys=KV_AXES, values=KV_AXES, slot_positions=Axes(BATCH, KV_SLOTS), lengths=Axes(BATCH))

    def mask_info(self, kv_positions: jax.Array) -> MaskInfo:
        return MaskInfo(kv_positions, **{self.SPAN_NAME: self.span})

    def update_entry(self, index, keys, values, positions):
        """Write ``[B, H_kv, T, D]`` at ``positions`` ``[B, T]`` into ring ``index``.

        Returns the ring after the write when every query's span is still in it (T <= R + 1:
        decode, or verifying up to R + 1 draft tokens); otherwise the ring before the write
        followed by the T new tokens, so a long prefill's first queries still see keys
        that the ring will not keep. Each row keeps only its own last N tokens, so no two
        writes of one update land on the same slot.
        """
        positions = check_update_inputs(self, index, keys, values, positions)
        num_slots = self.keys.shape[-2]
        old_lengths = entry(self.lengths, index)
        lengths = lengths_after(old_lengths, positions)
        kept = (positions >= 0) & (positions >= lengths[:, None] - num_slots)
        slots = jnp.where(kept, positions % num_slots, num_slots)
        rows = jnp.arange(keys.shape[0])[:, None]
        new = self.replace(
            keys=write_slots(self.keys, index, keys, slots),
            values=write_slots(self.values, index, values, slots),
            slot_positions=self.slot_positions.at[index, rows, slots].set(positions, mode="drop"),
            lengths=self.lengths.at[index].set(lengths),
        )
        if positions.shape[1] <= self.rollback_slots + 1:
            kv_positions = visible_positions(entry(new.slot_positions, index), lengths)
            return new, KVView(new.keys, new.values, index, self.mask_info(kv_positions))
        return new, self.ring_then_new(index, keys, values, positions)

    def ring_then_new(self, index, keys, values, positions) -> KVView:
        """Ring ``index`` before the write followed by the ``[B, H_kv, T, D]`` new tokens, padding
        zeroed: a masked slot still enters the weighted sum with weight 0, and 0 * NaN is NaN."""
        real = (positions >= 0)[:, None, :, None]
        old_positions = visible_positions(entry(self.slot_positions, index), entry(self.lengths, index))
        kv_positions = jnp.concatenate([old_positions, positions], axis=1)
        all_keys = jnp.concatenate([entry(self.keys, index), jnp.where(real, keys, 0)], axis=2)
        all_values = jnp.concatenate([entry(self.values, index), jnp.where(real, values, 0)], axis=2)
        return KVView.of(all_keys, all_values, self.mask_info(kv_positions))

    def reset(self):
        return self.replace(
            keys=jnp.zeros_like(self.keys),
            values=jnp.zeros_like(self.values),
            slot_positions=jnp.full_like(self.slot_positions, -1),
            lengths=jnp.zeros_like(self.lengths),
        )


@pytree_class
class SlidingWindowLayer(RingBufferLayer):
    """Sliding-window K/V: a ring ``[B, H_kv, W + R, D]``; a query at q sees ``(q - W, q]``."""

    SPAN_NAME = "window"
    MEMORY_FORMULA = "2·B·(W+R)·H_kv·D·bytes + 4·B·(W+R+1)"

    @property
    def window(self) -> int:
        return self.span


@pytree_class
class ChunkedLayer(RingBufferLayer):
    """Chunked-attention K/V: a ring ``[B, H_kv, C + R, D]``; a query sees its own chunk."""

    SPAN_NAME = "chunk"
    MEMORY_FORMULA = "2·B·(C+R)·H_kv·D·bytes + 4·B·(C+R+1)"

    @property
    def chunk(self) -> int:
        return self.span
