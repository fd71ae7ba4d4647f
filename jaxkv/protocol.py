"""The contract every cache layer keeps, and the small helpers the layers share.

A cache layer is an immutable pytree. Its ``update`` is a pure function:

    new_layer, (keys, values, mask_info) = layer.update(keys, values, positions)

* ``keys``, ``values``: ``[B, H_kv, T, D]``, the T new tokens of each row.
* ``positions``: ``[B, T]`` int, the absolute position of each new token. A negative
  position marks padding: it is not written and does not advance the row. Valid positions
  of a row are consecutive and start at that row's current length (checked eagerly).
* returned ``keys``/``values``: ``[B, H_kv, S, D]``, what attention reads for these
  queries; ``mask_info.kv_positions`` ``[B, S]`` says which absolute position each of the
  S slots holds (``-1``: nothing). Masks are derived from these positions only, never by
  looking at the stored values, so what the layer returns and what the mask admits agree
  by construction.

The container stores layers of one kind stacked along a leading layer axis, so a model
can scan over its layers with the cache in the carry. A layer therefore also implements
``update_entry(index, keys, values, positions)``: the same update, applied to entry
``index`` (an int or a traced scalar) of a stacked layer, writing that entry in place.
``update`` on a single layer is ``update_entry`` on a stack of one.

Every array leaf of a (single) layer has the batch as its leading axis; that is what lets the
container reorder beams and select or repeat rows generically (``gather_rows``) without
knowing the storage. A layer whose storage is not batch-major (a paged pool indexed
through a block table) overrides ``gather_rows``.

The protocol also admits layers without per-token K/V (a linear-attention layer carries
a conv and a recurrent state and returns no ``KVView``), quantized storage (the update
dequantizes what it returns), and paged storage (``kv_positions`` come from the block
table): the container only calls the methods below.
"""

from __future__ import annotations

from typing import Protocol, Self, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


class MaskInfo(struct.PyTreeNode):
    """What attention needs to build its mask for the returned K/V.

    ``kv_positions``: ``[B, S]`` int32, the absolute position held by each slot, -1 if the
    slot holds nothing attention may see. ``window``: a query at q sees keys with
    ``q - window < k <= q``. ``chunk``: a query sees only keys of its own chunk
    (``k // chunk == q // chunk``). Both are static. ``slots_used``: see below.
    """

    kv_positions: jax.Array
    window: int | None = struct.field(pytree_node=False, default=None)
    chunk: int | None = struct.field(pytree_node=False, default=None)
    # Optional int32 scalar: no slot at or past it holds a visible token, so attention may
    # stop reading there (a preallocated buffer is mostly empty). None: read every slot.
    slots_used: jax.Array | None = None


class KVView(struct.PyTreeNode):
    """What one ``update`` hands to attention: a layer's K/V slots and their ``MaskInfo``.

    ``keys``/``values`` are ``[B, H_kv, S, D]``; ``k, v, mask_info = view`` unpacks them.
    The view keeps them as entry ``index`` of a stack ``[L, B, H_kv, S, D]`` (the
    container's storage, a stack of one for a single layer) instead of slicing the entry
    out: ``read(start, size)`` cuts a block straight from the stack, so blocked attention
    over a stacked cache never copies the layer's whole buffer, and a decode step costs
    the filled length, not the capacity. Storage that cannot be read as plain slots (a
    quantized layer dequantizing block by block) provides its own view with the same
    ``mask_info``, ``shape``, ``read``, ``keys`` and ``values``.
    """

    key_stack: jax.Array  # [L, B, H_kv, S, D]
    value_stack: jax.Array
    index: jax.Array | int
    mask_info: MaskInfo

    @classmethod
    def of(cls, keys: jax.Array, values: jax.Array, mask_info: MaskInfo) -> KVView:
        """A view of plain ``[B, H_kv, S, D]`` arrays."""
        return cls(keys[None], values[None], 0, mask_info)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H_kv, S, D)`` of ``keys``."""
        return self.key_stack.shape[1:]

    @property
    def keys(self) -> jax.Array:
        return entry(self.key_stack, self.index)

    @property
    def values(self) -> jax.Array:
        return entry(self.value_stack, self.index)

    def read(self, start, size: int) -> tuple[jax.Array, jax.Array]:
        """Keys and values ``[B, H_kv, size, D]`` of slots ``[start, start + size)``."""
        _, batch, heads, _, dim = self.key_stack.shape
        corner, shape = (self.index, 0, 0, start, 0), (1, batch, heads, size, dim)
        return (
            jax.lax.dynamic_slice(self.key_stack, corner, shape)[0],
            jax.lax.dynamic_slice(self.value_stack, corner, shape)[0],
        )

    def __iter__(self):
        return iter((self.keys, self.values, self.mask_info))


@runtime_checkable
class CacheLayer(Protocol):
    """One layer's storage strategy. See the module docstring for the contract."""

    lengths: jax.Array  # [B] int32: tokens seen by each row (absolute count, not slots)

    def update(self, keys: jax.Array, values: jax.Array, positions: jax.Array) -> tuple[Self, KVView]: ...

    def update_entry(self, index, keys: jax.Array, values: jax.Array, positions: jax.Array) -> tuple[Self, KVView]:
        """``update`` of entry ``index`` of a stacked layer (leaves ``[L, ...]``), in place."""

    def rollback(self, num_tokens: jax.Array | int) -> Self: ...

    def reset(self) -> Self: ...

    def gather_rows(self, indices: jax.Array) -> Self: ...

    @property
    def max_length(self) -> int | None:
        """Longest sequence a row can hold before it overflows; None if unbounded."""

    @property
    def max_rollback(self) -> int | None:
        """Most tokens ``rollback`` can undo; None if it can undo the whole sequence."""

    @property
    def nbytes(self) -> int: ...


class BatchMajorLayer:
    """Shared behaviour of layers whose every array leaf is batch-major."""

    def update(self, keys: jax.Array, values: jax.Array, positions: jax.Array) -> tuple[Self, KVView]:
        """Write ``[B, H_kv, T, D]`` at ``positions`` ``[B, T]``; see the module docstring."""
        stack, view = jax.tree.map(lambda leaf: leaf[None], self).update_entry(0, keys, values, positions)
        return jax.tree.map(lambda leaf: leaf[0], stack), view

    def gather_rows(self, indices: jax.Array) -> Self:
        """Rows ``indices`` ``[B']`` of every leaf: beam reorder, select and repeat."""
        indices = jnp.asarray(indices, jnp.int32)
        return jax.tree.map(lambda leaf: jnp.take(leaf, indices, axis=0), self)

    @property
    def nbytes(self) -> int:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self))

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]


def is_traced(*xs) -> bool:
    """True when any value is abstract (inside jit/scan): data-dependent checks must wait."""
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def lengths_after(lengths: jax.Array, positions: jax.Array) -> jax.Array:
    """Row lengths after writing ``positions`` ``[B, T]`` (negative = padding)."""
    return jnp.maximum(lengths, jnp.max(positions, axis=1).astype(jnp.int32) + 1)


def entry(stack: jax.Array, index) -> jax.Array:
    """Entry ``index`` (int or traced scalar) of a stacked leaf ``[L, ...]``."""
    return jax.lax.dynamic_index_in_dim(stack, index, axis=0, keepdims=False)


def write_slots(buffer: jax.Array, index, new: jax.Array, slots: jax.Array) -> jax.Array:
    """Write ``new`` ``[B, H, T, D]`` into entry ``index`` of ``buffer`` ``[L, B, H, S, D]``
    at ``slots`` ``[B, T]``.

    A slot outside ``[0, S)`` is dropped, never clamped: ``lax.dynamic_update_slice``
    would move an out-of-range write back inside the buffer and overwrite live tokens.
    Per-row offsets lower to one scatter into the stack, which XLA performs in place on a
    donated buffer (no copy of the layer's slice).
    """
    rows = jnp.arange(buffer.shape[1])[:, None]
    return buffer.at[index, rows, :, slots].set(jnp.swapaxes(new, 1, 2), mode="drop")


def check_update_inputs(stack, index, keys: jax.Array, values: jax.Array, positions) -> jax.Array:
    """Shape and dtype checks (always, at trace time) and position checks (eagerly) for an
    update of entry ``index`` of a stacked layer whose ``keys`` are ``[L, B, H_kv, S, D]``.
    Returns the positions as int32."""
    name = type(stack).__name__
    positions = jnp.asarray(positions)
    expected = (stack.keys.shape[1], stack.keys.shape[2], None, stack.keys.shape[4])
    for what, x in (("keys", keys), ("values", values)):
        if x.ndim != 4 or x.shape[0] != expected[0] or x.shape[1] != expected[1] or x.shape[3] != expected[3]:
            raise ValueError(
                f"{name}.update: {what} has shape {tuple(x.shape)}, expected [B, H_kv, T, D] = "
                f"[{expected[0]}, {expected[1]}, T, {expected[3]}] as the cache was built"
            )
        if x.dtype != stack.keys.dtype:
            raise TypeError(
                f"{name}.update: {what} dtype {x.dtype} differs from the cache dtype "
                f"{stack.keys.dtype}; cast them or build the cache with dtype={x.dtype}"
            )
    if keys.shape != values.shape:
        raise ValueError(f"{name}.update: keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
    return check_positions(f"{name}.update", positions, (keys.shape[0], keys.shape[2]), stack.lengths, index)


def check_positions(caller: str, positions, shape: tuple[int, int], lengths_stack, index) -> jax.Array:
    """``positions`` must be ``shape`` ``[B, T]`` integers; eagerly, each row's valid ones
    must continue its length (entry ``index`` of ``lengths_stack`` ``[L, B]``). Returns
    them as int32; ``caller`` names the method in the errors."""
    positions = jnp.asarray(positions)
    if positions.shape != shape:
        raise ValueError(f"{caller}: positions has shape {tuple(positions.shape)}, expected [B, T] = {list(shape)}")
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"{caller}: positions must be integers, got {positions.dtype}")
    positions = positions.astype(jnp.int32)
    if is_traced(positions, lengths_stack, index):
        return positions
    pos, lengths = np.asarray(positions), np.asarray(lengths_stack[index])
    for row in range(pos.shape[0]):
        valid = pos[row][pos[row] >= 0]
        want = np.arange(lengths[row], lengths[row] + valid.size)
        if not np.array_equal(valid, want):
            raise ValueError(
                f"{caller}: row {row} has length {lengths[row]}, so its new tokens must sit at "
                f"positions {lengths[row]}, {lengths[row] + 1}, ... (negative for padding); got "
                f"{valid.tolist()}. Use Cache.next_positions, or rollback first to rewrite tokens"
            )
    return positions


def check_rollback(layer, num_tokens) -> None:
    """Eager errors for a rollback request (int or ``[B]``); nothing when traced."""
    n = np.asarray(num_tokens) if not is_traced(num_tokens) else None
    if n is None:
        return
    name, budget = type(layer).__name__, layer.max_rollback
    if np.any(n < 0):
        raise ValueError(f"{name}.rollback: cannot roll back a negative count {n.tolist()}")
    if budget is not None and np.any(n > budget):
        # A layer whose budget is not a ring's rollback_slots + 1 says how to size it (linear states).
        fix = (
            layer.rollback_hint(int(np.max(n)))
            if hasattr(layer, "rollback_hint")
            else f"build the cache with rollback_slots >= {np.max(n) - 1} (a ring of window + rollback_slots slots "
            f"undoes rollback_slots + 1)"
        )
        raise ValueError(f"{name}.rollback: asked to undo {np.max(n)} tokens but the layer can undo at most {budget}; {fix}")


def clamp_rollback(layer, num_tokens) -> jax.Array:
    """``num_tokens`` (int or ``[B]``) as a ``[B]`` vector, never below zero or past a row's start.

    Eagerly, asking for more than ``layer.max_rollback`` is an error; under jit the
    request is clamped to it (the container documents this).
    """
    check_rollback(layer, num_tokens)
    n = jnp.broadcast_to(jnp.asarray(num_tokens, jnp.int32), layer.lengths.shape)
    n = jnp.clip(n, 0, layer.lengths)
    return n if layer.max_rollback is None else jnp.minimum(n, layer.max_rollback)


def check_capacity(layer, positions, capacity: int) -> None:
    """Trace-time (T > capacity) and eager (row length > capacity) overflow errors."""
    name = type(layer).__name__
    if positions.shape[1] > capacity:
        raise ValueError(
            f"{name}.update: {positions.shape[1]} new tokens cannot fit in a capacity of {capacity}; "
            f"build the cache with max_length >= the longest sequence"
        )
    if not is_traced(positions):
        needed = int(np.max(np.asarray(positions), initial=-1)) + 1
        if needed > capacity:
            raise ValueError(
                f"{name}.update: a row would reach {needed} tokens but the capacity is {capacity}; "
                f"build the cache with max_length >= {needed}"
            )


def visible_positions(slot_positions: jax.Array, lengths: jax.Array) -> jax.Array:
    """Slot positions ``[B, N]`` with empty or rolled-back slots set to -1."""
    live = (slot_positions >= 0) & (slot_positions < lengths[:, None])
    return jnp.where(live, slot_positions, -1)
