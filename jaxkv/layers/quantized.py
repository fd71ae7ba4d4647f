"""Quantized K/V: int8, int4, int2 or fp8 codes with group scales, and a full-precision residual.

A ``QuantizedLayer`` stores K/V as integer codes (``nbits`` 8, 4 or 2, packed two or four
to a byte along the head dim) with an asymmetric scale and zero point per group, or as
fp8 (``e4m3`` or ``e5m2``) with a symmetric scale per group. A group is
``q_group_size`` consecutive channels of one token (axis 0, per token) or
``q_group_size`` consecutive tokens of one channel (axis -1, per channel), chosen for
keys and values independently (KIVI: keys per channel, values per token). The option
names and defaults are the reference's (``nbits=4``, ``axis_key=0``, ``axis_value=0``,
``q_group_size=64``, ``residual_length=128``).

The residual: the last tokens of a row stay in full precision in ``R = residual_length``
slots. When a token arrives at a full residual, the R residual tokens are quantized in
one step (so the newest token is always full precision), which keeps per-channel groups
whole: a row of length L holds ``Q = R·floor((L - 1) / R)`` quantized tokens and
``L - Q`` (1 to R) residual ones. With ``R = 0`` every token is quantized on arrival
(per-token axes only).

What attention sees: the layer's state after the update (quantized tokens dequantized,
residual tokens as they came). A query therefore sees a key quantized exactly when that
key's block of R was flushed by the end of the update. An update that stays between two
flushes (``exact_chunk_lengths`` tokens at most, e.g. aligned chunks of R) gives every
query what decoding token by token would; speculative decoding verifies its drafts in
such chunks so that its greedy output equals plain greedy decoding.

Scales and zero points are stored in float16 (4 bytes per int group, 2 per fp8 group):
float16 keeps 11 significant bits, so rounding a scale moves an int8 code by at most
about 0.13 of a step; bfloat16's 8 bits would double int8's error.

Rollback within the residual only shortens the row. Rolling back past it moves the last
partial block back into the residual in its dequantized (already lossy) form; that block
is quantized again when the residual next fills, so such tokens carry the error of two
quantizations. A sliding-window layer can undo ``rollback_slots + 1`` tokens, like the
other rings, counted from the furthest position its quantized store has held: rollbacks
without a feed in between share them (``rollback_budget``; a rollback within the residual
needs no store slot). Eagerly undoing more is an error, under jit the count is clamped.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.quantization import (
    PER_CHANNEL, PER_TOKEN, QuantizedTensor, QuantSpec, decode_codes, dequantize, empty_quantized, expand_scales,
    quantize,
)  # fmt: skip
from jaxkv.protocol import BatchMajorLayer, ChunkLimit, KVView, MaskInfo, Overflow, Refill, Rollback, check_capacity
from jaxkv.protocol import check_update_inputs, describe_extent
from jaxkv.protocol import entry, lengths_after, limit_rollback, ring_rollback_budget, visible_positions, write_slots
from jaxkv.protocol import KV_AXES, SlotView, pytree_class
from jaxkv.sharding import BATCH, KV_HEADS, KV_SLOTS, Axes


def dequantize_slots(q: QuantizedTensor, slots: jax.Array, spec: QuantSpec, axis: int, dtype) -> jax.Array:
    """Slots ``slots`` ``[B, K]`` of a batch-major ``q`` (codes ``[B, H, N, ·]``) dequantized:
    ``[B, H, K, D]``. Indices are clipped into the buffer (callers mask what they do not own)."""

    def take(x, rows):
        return jnp.take_along_axis(x, rows[:, None, :, None], axis=2, mode="clip")

    rows = slots if axis == PER_TOKEN else slots // spec.q_group_size
    scales, zeros = take(q.scales, rows), None if q.zeros is None else take(q.zeros, rows)
    if axis == PER_TOKEN:
        scales, zeros = (
            expand_scales(scales, spec.q_group_size, axis),
            None if zeros is None else expand_scales(zeros, spec.q_group_size, axis),
        )
    return decode_codes(take(q.codes, slots), scales, zeros, spec).astype(dtype)


def quantized_lengths(lengths: jax.Array, residual_length: int) -> jax.Array:
    """``[B]`` tokens held quantized by rows of ``lengths`` ``[B]``: R·floor((L - 1) / R)."""
    if residual_length == 0:
        return lengths
    return jnp.maximum(residual_length * ((lengths - 1) // residual_length), 0)


@pytree_class
class QuantizedView(SlotView):
    """What a full-attention ``QuantizedLayer`` hands to attention: slot ``p`` holds position
    ``p``, quantized below the row's ``quantized`` count and from the residual above it.

    ``read`` dequantizes only the requested block (plus the residual slots inside it), so
    blocked attention never builds a full-precision copy of the whole cache; blocked
    attention reads the residual once, as the view's tail (``split_tail``). The codes stay
    in the layer stack; the layer's scales and zero points (a 32nd or less of the values)
    are taken out of it and widened to float32 once per update, not once per value read:
    XLA's CPU backend fuses a dequantization into each dot that reads it, and a float16
    convert per value there cost more than the rest of the read.
    """

    key_codes: jax.Array  # [L, B, H_kv, N, D·bits/8]: entry ``index`` is this layer's
    value_codes: jax.Array
    key_scales: QuantizedTensor  # scales and zero points of entry ``index``, float32; no codes
    value_scales: QuantizedTensor
    residual_keys: jax.Array  # [B, H_kv, W, D] full-precision slots, slot i at position ``residual_start + i``
    residual_values: jax.Array
    residual_start: jax.Array  # [B] int32
    quantized: jax.Array  # [B] int32: slots below it are read from the store, the others from the residual
    lengths: jax.Array  # [B] int32 row lengths
    index: jax.Array | int
    mask_info: MaskInfo
    spec: QuantSpec = struct.field(pytree_node=False)
    computed_reads = True  # read dequantizes (see KVView)

    @classmethod
    def of_entry(cls, keys: QuantizedTensor, values: QuantizedTensor, index, **fields) -> QuantizedView:
        """The view of entry ``index`` of a layer's stacked store ``keys``/``values`` (leaves ``[L, B, ...]``)."""

        def scales_of(store: QuantizedTensor) -> QuantizedTensor:
            widen = lambda x: None if x is None else entry(x, index).astype(jnp.float32)
            return QuantizedTensor(None, widen(store.scales), widen(store.zeros))

        return cls(keys.codes, values.codes, scales_of(keys), scales_of(values), index=index, **fields)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        batch, heads, _, dim = self.residual_keys.shape
        return batch, heads, self.key_codes.shape[3], dim

    def _read_one(self, codes, scales: QuantizedTensor, residual: jax.Array, axis: int, start, size: int) -> jax.Array:
        _, batch, heads, _, code_dim = codes.shape
        group = self.spec.q_group_size
        block_codes = jax.lax.dynamic_slice(codes, (self.index, 0, 0, start, 0), (1, batch, heads, size, code_dim))[0]
        if axis == PER_TOKEN:

            def take(x):  # the block's rows, one scale per value
                rows = jax.lax.dynamic_slice_in_dim(x, start, size, axis=2)
                return expand_scales(rows, group, axis)

        else:  # one scale row per group of tokens: the rows covering the block, one per slot

            def take(x):
                # ceil(size / G) + 1 rows hold any ``size`` slots, whatever ``start``'s offset in its group.
                num_rows, total_rows = -(-size // group) + 1, x.shape[2]
                # Clamped so the slice stays inside (dynamic_slice would shift it silently).
                first = jnp.minimum(start // group, max(total_rows - num_rows, 0))
                rows = jax.lax.dynamic_slice_in_dim(x, first, min(num_rows, total_rows), axis=2)
                per_slot = expand_scales(rows, group, axis)
                return jax.lax.dynamic_slice_in_dim(per_slot, start - first * group, size, axis=2)

        zeros = None if scales.zeros is None else take(scales.zeros)
        block = decode_codes(block_codes, take(scales.scales), zeros, self.spec).astype(residual.dtype)
        if self.spec.residual_length == 0 or residual.shape[2] == 0:  # all quantized, or split_tail's body
            return block
        slot_positions = start + jnp.arange(size)[None, :]  # [B, size]
        offset = slot_positions - self.residual_start[:, None]  # residual slot
        from_residual = jnp.take_along_axis(
            residual, jnp.clip(offset, 0, residual.shape[2] - 1)[:, None, :, None], axis=2
        )
        return jnp.where((slot_positions >= self.quantized[:, None])[:, None, :, None], from_residual, block)

    def _read_keys(self, start, size: int) -> jax.Array:
        return self._read_one(self.key_codes, self.key_scales, self.residual_keys, self.spec.axis_key, start, size)

    def _read_values(self, start, size: int) -> jax.Array:
        spec = self.spec
        return self._read_one(self.value_codes, self.value_scales, self.residual_values, spec.axis_value, start, size)

    def read(self, start, size: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values ``[B, H_kv, size, D]`` of slots ``[start, start + size)``, dequantized."""
        return self._read_keys(start, size), self._read_values(start, size)

    @property
    def keys(self) -> jax.Array:
        return self._read_keys(0, self.shape[2])

    @property
    def values(self) -> jax.Array:
        return self._read_values(0, self.shape[2])

    def split_tail(self) -> tuple[QuantizedView, KVView | None]:
        """Blocked attention's split: a body holding only the quantized slots (no residual
        to merge into each block) and the residual as a tail, slot i at ``residual_start + i``."""
        if self.spec.residual_length == 0:
            return self, None
        batch, heads, capacity, dim = self.shape
        slot_index = jnp.arange(capacity, dtype=jnp.int32)[None, :]
        kv_positions = jnp.where(slot_index < self.quantized[:, None], self.mask_info.kv_positions, -1)
        used = jnp.minimum(jnp.max(self.quantized), capacity)
        empty = jnp.zeros((batch, heads, 0, dim), self.residual_keys.dtype)
        body = self.replace(
            residual_keys=empty, residual_values=empty,
            mask_info=self.mask_info.replace(kv_positions=kv_positions, slots_used=used),
        )  # fmt: skip
        # A residual slot is visible where the merged view shows it: not quantized, inside the row and the buffer.
        width = self.residual_keys.shape[2]
        tail_positions = self.residual_start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        end = jnp.minimum(self.lengths, capacity)[:, None]
        visible = (tail_positions >= self.quantized[:, None]) & (tail_positions < end)
        tail_info = self.mask_info.replace(kv_positions=jnp.where(visible, tail_positions, -1), slots_used=None)
        tail = KVView.of(self.residual_keys, self.residual_values, tail_info)
        return body, tail

    def __iter__(self):
        return iter((self.keys, self.values, self.mask_info))


class Staging(NamedTuple):
    """Where one update of a ``QuantizedLayer`` entry puts its tokens: the old residual and the T
    new tokens in a staging buffer of W slots, slot i holding position ``old_quantized + i``."""

    spec: QuantSpec
    lengths: jax.Array  # [B] row lengths after the update
    old_quantized: jax.Array  # [B] Q before the update
    new_quantized: jax.Array  # [B] Q after it
    flushed: jax.Array  # [B] leading staging slots that become quantized
    slots: jax.Array  # [B, T] staging slot of each new token; W (dropped) for padding
    positions: jax.Array  # [B, W] position of each staging slot
    store_slots: jax.Array  # [B, W] store slot of each flushed staging slot; N (dropped) for the others
    residual_slots: jax.Array  # [B, T] residual slot of each new token kept in full precision; R (dropped) else

    def stage(self, residual: jax.Array, new: jax.Array) -> jax.Array:
        """The residual ``[B, H_kv, R, D]`` with the new tokens ``[B, H_kv, T, D]`` written: ``[B, H_kv, W, D]``."""
        batch, heads, _, dim = new.shape
        pad = jnp.zeros((batch, heads, self.positions.shape[1] - residual.shape[2], dim), new.dtype)
        return write_slots(jnp.concatenate([residual, pad], axis=2)[None], 0, new, self.slots)[0]

    def flush(self, store: QuantizedTensor, index, q: QuantizedTensor, axis: int) -> QuantizedTensor:
        """``store`` with the flushed blocks of the quantized staging buffer ``q`` written into entry ``index``."""
        scale_slots = self.store_slots
        if axis == PER_CHANNEL:  # one row per group: the slot of the group's first token
            group, num_slots, num_rows = self.spec.q_group_size, store.codes.shape[3], store.scales.shape[3]
            first = self.store_slots[:, ::group]
            scale_slots = jnp.where(first < num_slots, first // group, num_rows)
        return QuantizedTensor(
            write_slots(store.codes, index, q.codes, self.store_slots),
            write_slots(store.scales, index, q.scales, scale_slots),
            None if q.zeros is None else write_slots(store.zeros, index, q.zeros, scale_slots),
        )

    def keep(self, residual_stack: jax.Array, index, staged: jax.Array) -> jax.Array:
        """The residual stack with the new tokens that stay in full precision written into entry
        ``index``, taken from the staging buffer ``staged`` ``[B, H_kv, W, D]``: Q is a multiple of
        R, so residual slot s (position Q + s) is the position modulo R, and after a flush every
        position of the new residual is a new token's.

        Why so: XLA's CPU backend copies the whole residual stack (twice, every layer of every
        step) when an update both reads the old entry and writes the stack in a way that does not
        depend on that read, or when anything reads the stack after the write. Here only the
        kept tokens are written, taken from the staging buffer (so after its read; the update
        builds that buffer once), and the view attends over the staging buffer, not the
        written stack."""
        if self.spec.residual_length == 0:  # every token is quantized on arrival
            return residual_stack
        new = jnp.take_along_axis(staged, self.slots[:, None, :, None], axis=2, mode="clip")
        return write_slots(residual_stack, index, new, self.residual_slots)


@pytree_class
class QuantizedLayer(BatchMajorLayer, Rollback, Refill, Overflow, ChunkLimit):
    """Quantized K/V ``[B, H_kv, N, D·bits/8]`` codes + group scales, and an R-token residual.

    Full attention (``window`` None): N = ``max_length`` slots, slot p holds position p;
    overflow behaves as ``StaticLayer``'s. Sliding window W: a ring of N = W +
    ``rollback_slots`` slots (rounded up to whole per-channel groups), slot ``p % N``.
    See the module docstring for the residual and what attention sees.
    """

    quantized_keys: QuantizedTensor
    quantized_values: QuantizedTensor
    residual_keys: jax.Array  # [B, H_kv, R, D] cache dtype; slot s holds position Q + s
    residual_values: jax.Array
    slot_positions: jax.Array | None  # [B, N] int32 for a ring (-1 empty); None for full attention
    lengths: jax.Array  # [B] int32
    spec: QuantSpec = struct.field(pytree_node=False)
    window: int | None = struct.field(pytree_node=False, default=None)
    rollback_slots: int = struct.field(pytree_node=False, default=0)

    MEMORY_FORMULA = (
        "2·B·H_kv·(N·D·(b/8 + z/G) + R·D·bytes) + 4·B (+ 4·B·N for a ring); N = S_max or W+R_rb, "
        "b bits, z = 4 (int: f16 scale + zero) or 2 (fp8: f16 scale), G group, R residual"
    )

    @classmethod
    def create(
        cls, batch_size, num_kv_heads, head_dim, spec: QuantSpec, dtype=jnp.float32, max_length=None, window=None,
        rollback_slots=0,
    ):  # fmt: skip
        """Full attention with ``max_length`` slots, or a sliding ring when ``window`` is given."""
        spec.check_head_dim(head_dim)
        if (max_length is None) == (window is None):
            raise ValueError("QuantizedLayer: pass max_length (full attention) or window (sliding), exactly one")
        if (window or max_length) <= 0 or rollback_slots < 0:
            raise ValueError(f"QuantizedLayer: capacity/window must be positive and rollback_slots >= 0, got "
                             f"{window or max_length}, {rollback_slots}")  # fmt: skip
        slots = cls.num_slots(spec, max_length, window, rollback_slots)
        residual = jnp.zeros((batch_size, num_kv_heads, spec.residual_length, head_dim), dtype)
        return cls(
            empty_quantized(batch_size, num_kv_heads, head_dim, slots, spec, spec.axis_key),
            empty_quantized(batch_size, num_kv_heads, head_dim, slots, spec, spec.axis_value),
            residual,
            residual,
            None if window is None else jnp.full((batch_size, slots), -1, jnp.int32),
            jnp.zeros((batch_size,), jnp.int32),
            spec,
            window,
            rollback_slots,
        )

    @staticmethod
    def num_slots(spec: QuantSpec, max_length, window, rollback_slots) -> int:
        if window is None:
            return max_length
        slots = window + rollback_slots
        # A ring's per-channel groups must not straddle its end: whole groups of slots.
        if PER_CHANNEL in (spec.axis_key, spec.axis_value):
            slots = math.ceil(slots / spec.q_group_size) * spec.q_group_size
        return slots

    @classmethod
    def kv_bytes(
        cls, batch_size, seq_len, num_kv_heads, head_dim, dtype, quantization: QuantSpec, max_length=None, span=None,
        rollback_slots=0, **_,
    ) -> int:  # fmt: skip
        """Bytes of the layer: codes, float16 scales (and zero points), residual, positions."""
        spec = quantization
        slots = cls.num_slots(spec, None if span else (max_length or seq_len), span, rollback_slots)
        per_scale = 2 * (2 if spec.asymmetric else 1)
        total = batch_size * num_kv_heads * spec.residual_length * head_dim * jnp.dtype(dtype).itemsize * 2
        for axis in (spec.axis_key, spec.axis_value):
            scale_rows = slots if axis == PER_TOKEN else math.ceil(slots / spec.q_group_size)
            scale_cols = head_dim // spec.q_group_size if axis == PER_TOKEN else head_dim
            codes = slots * head_dim * spec.bits // 8
            total += batch_size * num_kv_heads * (codes + scale_rows * scale_cols * per_scale)
        return total + 4 * batch_size + (4 * batch_size * slots if span else 0)

    # --- shape-derived properties ------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.quantized_keys.codes.shape[-2]

    @property
    def keys(self) -> jax.Array:
        """The residual ``[..., B, H_kv, R, D]``: its layout and dtype are what updates must match."""
        return self.residual_keys

    @property
    def max_length(self) -> int | None:
        return self.capacity if self.window is None else None

    @property
    def max_rollback(self) -> int | None:
        return None if self.window is None else self.rollback_slots + 1

    @property
    def rollback_budget(self) -> jax.Array | None:
        """A ring's ``[B]`` (``[L, B]`` stacked) tokens each row can still undo, counted from the
        furthest position its quantized store has held (residual tokens are kept whole, so a
        rollback within the residual needs no store slot); None for full attention."""
        if self.window is None:
            return None
        return ring_rollback_budget(self.slot_positions, self.lengths, self.max_rollback)

    @property
    def overflowed(self) -> jax.Array:
        if self.window is None:
            return self.lengths > self.capacity
        return jnp.zeros(self.lengths.shape, bool)

    def exact_chunk_lengths(self) -> jax.Array | None:
        """``[B]`` (``[L, B]`` stacked): the most tokens the next update of each row may
        bring and still show every one of its queries what token-by-token decoding would.

        One update shows all its queries the state after it, and a block of R turns from
        full precision to quantized at the token that flushes it (position R·m): a chunk
        may therefore start at a flush but not run past the next one. It also never needs
        a rollback past a flush, the one rollback that loses precision. None with R = 0
        (every token is quantized on arrival, whatever the chunking).
        """
        residual_length = self.spec.residual_length
        return None if residual_length == 0 else residual_length - self.lengths % residual_length

    def describe(self) -> str:
        return describe_extent(self.rollback_slots, window=self.window)

    def logical_axes(self):
        lead = (BATCH, KV_HEADS, KV_SLOTS)
        return self.replace(
            quantized_keys=self.quantized_keys.logical_axes(*lead),
            quantized_values=self.quantized_values.logical_axes(*lead),
            residual_keys=KV_AXES,
            residual_values=KV_AXES,
            slot_positions=None if self.slot_positions is None else Axes(BATCH, KV_SLOTS),
            lengths=Axes(BATCH),
        )

    # --- update ------------------------------------------------------------------------
    def update_entry(self, index, keys, values, positions):
        """Write ``[B, H_kv, T, D]`` at ``positions`` ``[B, T]`` into entry ``index``.

        The old residual and the new tokens form a staging buffer ``[B, H_kv, R + T, D]``
        starting at the row's quantized count Q; it is quantized as a whole and the blocks
        that filled (positions below the new Q) are written to the store, the rest becomes
        the new residual. Padding (negative positions) is neither written nor counted.
        """
        positions = check_update_inputs(self, index, keys, values, positions)
        if self.window is None:
            check_capacity(self, positions, self.capacity)
        spec = self.spec
        plan = self.staging(entry(self.lengths, index), positions)
        staged_keys = plan.stage(entry(self.residual_keys, index), keys)
        staged_values = plan.stage(entry(self.residual_values, index), values)
        # Built once: XLA would otherwise duplicate the staging fusion into its consumers, one of
        # them scheduled after the residual write, and copy the whole residual stack (twice per
        # layer per step) to keep the old entry for it.
        staged_keys, staged_values = jax.lax.optimization_barrier((staged_keys, staged_values))
        # The whole staging buffer is quantized; only the blocks that filled are kept.
        quantized_keys = quantize(staged_keys, spec, spec.axis_key)
        quantized_values = quantize(staged_values, spec, spec.axis_value)
        new = self.replace(
            quantized_keys=plan.flush(self.quantized_keys, index, quantized_keys, spec.axis_key),
            quantized_values=plan.flush(self.quantized_values, index, quantized_values, spec.axis_value),
            residual_keys=plan.keep(self.residual_keys, index, staged_keys),
            residual_values=plan.keep(self.residual_values, index, staged_values),
            lengths=self.lengths.at[index].set(plan.lengths),
        )
        if self.window is None:
            return new, new.full_view(index, staged_keys, staged_values, plan)
        rows = jnp.arange(keys.shape[0])[:, None]
        slot_positions = self.slot_positions.at[index, rows, plan.store_slots].set(plan.positions, mode="drop")
        view = self.ring_view(index, (staged_keys, quantized_keys), (staged_values, quantized_values), plan)
        return new.replace(slot_positions=slot_positions), view

    def staging(self, old_lengths: jax.Array, positions: jax.Array) -> Staging:
        """Where an update at ``positions`` ``[B, T]`` of rows ``old_lengths`` ``[B]`` long puts
        its tokens: staging slot i holds position Q_old + i, padded to whole per-channel groups."""
        spec, slots_total = self.spec, self.capacity
        lengths = lengths_after(old_lengths, positions)
        old_quantized = quantized_lengths(old_lengths, spec.residual_length)
        new_quantized = quantized_lengths(lengths, spec.residual_length)
        flushed = new_quantized - old_quantized
        width = spec.residual_length + positions.shape[1]
        width += -width % spec.q_group_size if PER_CHANNEL in (spec.axis_key, spec.axis_value) else 0
        staging_positions = old_quantized[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        if self.window is None:  # past the capacity: dropped, like StaticLayer
            store_slots = jnp.where(staging_positions < slots_total, staging_positions, slots_total)
        else:  # a long update keeps only the last N quantized positions of the ring
            keep = staging_positions >= new_quantized[:, None] - slots_total
            store_slots = jnp.where(keep, staging_positions % slots_total, slots_total)
        return Staging(
            spec=spec,
            lengths=lengths,
            old_quantized=old_quantized,
            new_quantized=new_quantized,
            flushed=flushed,
            slots=jnp.where(positions >= 0, positions - old_quantized[:, None], width),
            positions=staging_positions,
            store_slots=jnp.where(jnp.arange(width)[None, :] < flushed[:, None], store_slots, slots_total),
            residual_slots=jnp.where(  # (unused with R = 0: nothing stays in full precision)
                positions >= new_quantized[:, None], positions % max(spec.residual_length, 1), spec.residual_length
            ),
        )

    def full_view(self, index, staged_keys, staged_values, plan: Staging) -> QuantizedView:
        """Full attention's view of entry ``index`` after the update: slot p holds position p,
        from the store below the new Q, from the staging buffers ``[B, H_kv, W, D]`` above it."""
        slot_index = jnp.arange(self.capacity, dtype=jnp.int32)[None, :]
        kv_positions = jnp.where(slot_index < plan.lengths[:, None], slot_index, -1)
        used = jnp.minimum(jnp.max(plan.lengths), self.capacity)
        return QuantizedView.of_entry(
            self.quantized_keys, self.quantized_values, index, residual_keys=staged_keys,
            residual_values=staged_values, residual_start=plan.old_quantized, quantized=plan.new_quantized,
            lengths=plan.lengths,
            mask_info=MaskInfo(kv_positions, slots_used=used), spec=self.spec,
        )  # fmt: skip

    def ring_view(self, index, staged_keys, staged_values, plan: Staging) -> KVView:
        """The ring before the update (its quantized tokens) followed by the staging buffer,
        flushed blocks fake-quantized: every key a query of this update may need, even
        those the write just overwrote, in the form the stored state holds them.
        ``staged_keys``/``staged_values``: the staging buffer and its quantized form."""
        spec, dtype = self.spec, self.residual_keys.dtype
        flushed_now = (jnp.arange(plan.positions.shape[1])[None, :] < plan.flushed[:, None])[:, None, :, None]

        def part(store: QuantizedTensor, staged_and_quantized, axis):
            staged, quantized = staged_and_quantized
            ring = dequantize(jax.tree.map(lambda x: entry(x, index), store), spec, axis, dtype)
            staged = jnp.where(flushed_now, dequantize(quantized, spec, axis, dtype), staged)
            return jnp.concatenate([ring, staged], axis=2)

        ring_positions = visible_positions(entry(self.slot_positions, index), plan.old_quantized)
        staged_positions = jnp.where(plan.positions < plan.lengths[:, None], plan.positions, -1)
        kv_positions = jnp.concatenate([ring_positions, staged_positions], axis=1)
        return KVView.of(
            part(self.quantized_keys, staged_keys, spec.axis_key),
            part(self.quantized_values, staged_values, spec.axis_value),
            MaskInfo(kv_positions, window=self.window),
        )

    # --- time edits -----------------------------------------------------------------------
    def rollback(self, num_tokens):
        """Forget the last ``num_tokens`` (int or ``[B]``) of each (single, unstacked) layer row;
        see the module docstring for a rollback past the residual."""
        lengths = self.lengths - limit_rollback(self, num_tokens, self.lengths)
        old_quantized = quantized_lengths(self.lengths, self.spec.residual_length)
        new_quantized = quantized_lengths(lengths, self.spec.residual_length)
        residual_positions = new_quantized[:, None] + jnp.arange(self.spec.residual_length)[None, :]
        from_store = (residual_positions < old_quantized[:, None])[:, None, :, None]
        store_slots = residual_positions % self.capacity

        def rebuilt(store, residual, axis):
            offset = jnp.clip(residual_positions - old_quantized[:, None], 0, None)
            old = jnp.take_along_axis(residual, offset[:, None, :, None], axis=2, mode="clip")
            return jnp.where(from_store, dequantize_slots(store, store_slots, self.spec, axis, residual.dtype), old)

        return self.replace(
            residual_keys=rebuilt(self.quantized_keys, self.residual_keys, self.spec.axis_key),
            residual_values=rebuilt(self.quantized_values, self.residual_values, self.spec.axis_value),
            lengths=lengths,
        )

    def reset(self):
        layer = jax.tree.map(jnp.zeros_like, self)
        return (
            layer
            if self.slot_positions is None
            else layer.replace(slot_positions=jnp.full_like(self.slot_positions, -1))
        )
