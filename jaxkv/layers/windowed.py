"""Attention that sees a bounded span, stored in a ring buffer of exactly that span.

``SlidingWindowLayer`` (Mistral, Gemma 3 local layers): a query at q sees keys in
``(q - W, q]``. ``ChunkedLayer`` (Llama 4): a query sees only the earlier keys of its own
chunk of C tokens. Either way no query ever needs more than the last W (or C) keys, so a
ring of that many slots suffices: slot ``p % N`` holds position ``p``.

Rollback: after undoing n tokens, the next query at position L - n needs the W - 1
positions before it, which a ring of W slots still holds only for n = 1. ``rollback_slots``
R adds R slots, so that undoing up to R + 1 tokens (speculative decoding) leaves every
needed key stored; the reference cannot roll a sliding window back past its window.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.protocol import (
    BatchMajorLayer,
    KVView,
    MaskInfo,
    check_update_inputs,
    clamp_rollback,
    entry,
    lengths_after,
    visible_positions,
    write_slots,
)



class RingBufferLayer(BatchMajorLayer):
    """The ring shared by the windowed layers; subclasses give ``span`` and the mask rule."""

    @classmethod
    def create(cls, batch_size, num_kv_heads, head_dim, span, dtype=jnp.float32, rollback_slots=0):
        if span <= 0 or rollback_slots < 0:
            raise ValueError(f"{cls.__name__}: span must be positive and rollback_slots >= 0, got {span}, {rollback_slots}")
        slots = span + rollback_slots
        shape = (batch_size, num_kv_heads, slots, head_dim)
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            slot_positions=jnp.full((batch_size, slots), -1, jnp.int32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            **{cls.SPAN_FIELD: span},
            rollback_slots=rollback_slots,
        )

    @classmethod
    def kv_bytes(cls, batch_size, seq_len, num_kv_heads, head_dim, dtype, span=None, rollback_slots=0, **_) -> int:
        """Bytes of the ring, whatever ``seq_len``: K/V, slot positions and lengths."""
        slots = span + rollback_slots
        return 2 * batch_size * slots * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize + 4 * batch_size * (slots + 1)

    @property
    def max_length(self) -> None:
        return None

    @property
    def max_rollback(self) -> int:
        return self.rollback_slots + 1

    @property
    def overflowed(self) -> jax.Array:
        return jnp.zeros(self.lengths.shape, bool)

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
        old_positions = visible_positions(entry(self.slot_positions, index), old_lengths)
        kv_positions = jnp.concatenate([old_positions, positions], axis=1)
        all_keys = jnp.concatenate([entry(self.keys, index), keys], axis=2)
        all_values = jnp.concatenate([entry(self.values, index), values], axis=2)
        return new, KVView.of(all_keys, all_values, self.mask_info(kv_positions))

    def rollback(self, num_tokens):
        return self.replace(lengths=self.lengths - clamp_rollback(self, num_tokens))

    def reset(self):
        return self.replace(
            keys=jnp.zeros_like(self.keys),
            values=jnp.zeros_like(self.values),
            slot_positions=jnp.full_like(self.slot_positions, -1),
            lengths=jnp.zeros_like(self.lengths),
        )


@struct.dataclass
class SlidingWindowLayer(RingBufferLayer):
    """Sliding-window K/V: a ring ``[B, H_kv, W + R, D]``; a query at q sees ``(q - W, q]``."""

    keys: jax.Array  # [B, H_kv, W + R, D]
    values: jax.Array  # [B, H_kv, W + R, D]
    slot_positions: jax.Array  # [B, W + R] int32, -1 = empty
    lengths: jax.Array  # [B] int32: tokens seen, not slots filled
    window: int = struct.field(pytree_node=False)
    rollback_slots: int = struct.field(pytree_node=False, default=0)

    SPAN_FIELD = "window"
    MEMORY_FORMULA = "2·B·(W+R)·H_kv·D·bytes + 4·B·(W+R+1)"

    @property
    def span(self) -> int:
        return self.window

    def mask_info(self, kv_positions):
        return MaskInfo(kv_positions, window=self.window)


@struct.dataclass
class ChunkedLayer(RingBufferLayer):
    """Chunked-attention K/V: a ring ``[B, H_kv, C + R, D]``; a query sees its own chunk."""

    keys: jax.Array  # [B, H_kv, C + R, D]
    values: jax.Array  # [B, H_kv, C + R, D]
    slot_positions: jax.Array  # [B, C + R] int32, -1 = empty
    lengths: jax.Array  # [B] int32
    chunk: int = struct.field(pytree_node=False)
    rollback_slots: int = struct.field(pytree_node=False, default=0)

    SPAN_FIELD = "chunk"
    MEMORY_FORMULA = "2·B·(C+R)·H_kv·D·bytes + 4·B·(C+R+1)"

    @property
    def span(self) -> int:
        return self.chunk

    def mask_info(self, kv_positions):
        return MaskInfo(kv_positions, chunk=self.chunk)
