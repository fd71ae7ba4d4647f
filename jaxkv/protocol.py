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

Every array leaf of a (single) layer has the batch as its leading axis, except where a
layer says otherwise (a paged pool indexed through a block table).

The core (``CacheLayer``), what every layer has and the container may always call:
``lengths``; ``update``/``update_entry`` (a layer holding only a linear state refuses them)
and ``attend_entry`` (the update, then attention over what it returned); the entry helpers
``entry_view``, ``store_entry`` and ``unstacked``; ``reset``; ``logical_axes``;
``max_length``; ``nbytes`` and ``describe``.

Capabilities, each a class a layer opts into by inheriting it. The container asks the
class (``has``, once per trace: nothing at run time) and a layer without the one an
operation needs gets an error naming both ("PackedStateLayer cannot roll back (no Rollback
capability)"); ``WHY_NOT`` lets a layer say why and what to use instead.

* ``Rollback``: ``rollback(n)`` forgets each row's last n tokens. ``max_rollback`` bounds
  one call; ``rollback_budget`` is what each row has left where rollbacks without a feed in
  between share one budget (rings, linear-attention states). Eagerly asking for more is an
  error naming the fix; under jit the count is clamped (``limit_rollback``), and the
  container clamps every layer alike (a layer without the capability: to 0) so that all
  stay in step.
* ``RowSelection``: ``gather_rows`` (beam reorder, select, repeat).
* ``Growth``: ``grow(capacity)``; ``Cache.grow`` grows the layers that have it.
* ``Eviction``: ``evict_to(spec, ...)``, cut to an ``EvictionSpec``'s budget (``Cache.evict``).
* ``DepthBudgets``: ``for_layers``, entries that differ by depth (PyramidKV's budgets).
* ``HeldTokens`` and ``Refill``: a source hands its tokens over (``held_entry``), a target
  is filled from a source (``filled_from``): one prefill refilled into many caches
  (``jaxkv.research.observer.refill``).
* ``HostMemory``: ``in_host_memory`` and ``host_leaves``, a layer that keeps its K/V in host
  memory and reads only what a step needs from it (page retrieval under ``offload``).
* ``LinearState``: ``update_state``/``update_state_entry`` (``jaxkv.layers.linear``).
* ``Overflow``: ``overflowed``, rows written past a fixed capacity under jit.
* ``ChunkLimit``: ``exact_chunk_lengths``, the longest update that shows every query what
  token-by-token decoding would (a quantized residual).

The contract admits layers without per-token K/V (a linear-attention layer carries a conv
and a recurrent state and returns no ``KVView``), quantized storage (the update
dequantizes what it returns) and paged storage (``kv_positions`` come from the block
table).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.kernels.backends import XLA
from jaxkv.kernels.dense import dense_decode, dense_prefill, dense_route
from jaxkv.sharding import BATCH, HEAD_DIM, KV_HEADS, KV_SLOTS, Axes, Layout
from jaxkv.softmax import attention_mask, dense_attention


def pytree_class(cls: type) -> type:
    """``cls`` as a frozen dataclass and a pytree whose tree structure names ``cls``: fields as
    ``flax.struct``'s (``struct.field(pytree_node=False)`` marks a static field, part of the
    structure), and ``replace``.

    ``flax.struct.dataclass`` registers through ``jax.tree_util.register_dataclass``, whose tree
    structures compare equal across classes of equal field names and static values (their
    hashes differ): ``SlidingWindowLayer`` and ``ChunkedLayer``, ``StaticLayer`` and
    ``DynamicLayer``. ``jax.jit``'s cache, which looks executables up by structure, could hand
    one class the executable traced for the other (a sliding ring's view masked as a chunk's).
    A node registered by its flatten functions compares its class too.
    """
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    children = tuple(f.name for f in fields if f.metadata.get("pytree_node", True))
    static = tuple(f.name for f in fields if not f.metadata.get("pytree_node", True))

    def flatten_with_keys(node):
        keyed = [(jax.tree_util.GetAttrKey(name), getattr(node, name)) for name in children]
        return keyed, tuple(getattr(node, name) for name in static)

    def flatten(node):
        return [getattr(node, name) for name in children], tuple(getattr(node, name) for name in static)

    def unflatten(static_values, child_values):
        return cls(**dict(zip(children, child_values)), **dict(zip(static, static_values)))

    def replace(self, **changes):
        """A copy with ``changes`` (field name -> value)."""
        return dataclasses.replace(self, **changes)

    cls.replace = replace
    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    return cls


@pytree_class
class MaskInfo:
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


class SlotView:
    """A view attention reads slot by slot (``KVView`` and views like it: ``keys``/``values``,
    ``mask_info``, ``read``, ``split_tail``). A view decides how it is read: ``attend``."""

    def attend(self, queries, q_positions, *, scale: float, logit_softcap=None, block_size=None, query_weights=None):
        """Softmax attention of ``queries`` ``[B, H_q, T, D]`` over these slots, block by block up
        to the filled ones (``jaxkv.softmax.dense_attention``)."""
        options = dict(scale=scale, logit_softcap=logit_softcap, block_size=block_size, query_weights=query_weights)
        return dense_attention(queries, self, q_positions, **options)


@pytree_class
class KVView(SlotView):
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
    # Does ``read`` compute its blocks (True: a quantized view dequantizes them) or cut them
    # from storage? Attention arranges its products by it (``Queries.per_head``).
    computed_reads = False

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

    def split_tail(self) -> tuple[KVView, KVView | None]:
        """The view as blocked attention reads it: a body read block by block up to its
        ``slots_used``, and a short tail read whole after it (None: no tail). Together they
        hold the same visible slots as the view. A quantized layer's tail is its
        full-precision residual, so the blocks dequantize codes and nothing else."""
        return self, None

    def __iter__(self):
        return iter((self.keys, self.values, self.mask_info))


@pytree_class
class PositionalView(KVView):
    """A ``KVView`` of a layer whose slot p holds position p (``PositionalLayer``) read under an
    attention ``backend`` (``jaxkv.kernels``): its decode tokens go to the backend's dense decode
    kernel, its prefills to cuDNN, when ``jaxkv.kernels.dense.dense_route`` finds nothing they
    lack; everything else to XLA.
    ``lengths`` ``[B]``: the tokens each row holds (slots ``0 .. lengths - 1``); ``sharding``: the
    mesh and rules the buffer is sharded by (the kernels run per device: ``jaxkv.kernels.dense``)."""

    lengths: jax.Array | None = None
    backend: str = struct.field(pytree_node=False, default=XLA)
    sharding: Layout | None = struct.field(pytree_node=False, default=None)

    def route(self, queries: jax.Array, logit_softcap, query_weights) -> str | None:
        """Why ``queries`` ``[B, H_q, T, D]`` are read by XLA (``dense_route``); None: by the kernel."""
        return dense_route(
            self.backend, num_queries=queries.shape[2], num_slots=self.shape[2], dtype=self.key_stack.dtype,
            logit_softcap=logit_softcap, slot_mass=query_weights is not None,
        )  # fmt: skip

    def attend(self, queries, q_positions, *, scale: float, logit_softcap=None, block_size=None, query_weights=None):
        """``KVView.attend``; one query per row by the decode kernel over slots ``0 .. min(length, q + 1)
        - 1`` (causal, and a row's slots past its length hold nothing visible), several by cuDNN
        under the view's mask: ``[B, H_q, T, D]``."""
        if self.route(queries, logit_softcap, query_weights) is not None:
            options = dict(logit_softcap=logit_softcap, block_size=block_size, query_weights=query_weights)
            return super().attend(queries, q_positions, scale=scale, **options)
        if queries.shape[2] > 1:
            mask = attention_mask(q_positions, self.mask_info)  # [B, T, S]
            out = dense_prefill(queries, self.keys, self.values, mask, scale=scale, sharding=self.sharding)
            return out.astype(queries.dtype)
        visible = jnp.minimum(self.lengths, jnp.maximum(q_positions[:, 0] + 1, 0))
        decoded = (self.backend, queries[:, :, 0], self.keys, self.values, visible)
        out = dense_decode(*decoded, scale=scale, sharding=self.sharding)
        return out[:, :, None].astype(queries.dtype)


class CacheLayer(abc.ABC):
    """The core every layer has (see the module docstring); optional parts are ``Capability``
    classes a layer inherits.

    A layer implements ``reset``, ``logical_axes``, ``max_length`` and ``update_entry`` (a layer
    holding only a linear-attention state keeps the default, which refuses K/V).
    """

    lengths: jax.Array  # [B] int32 ([L, B] stacked): tokens seen by each row (absolute count, not slots)
    # Why the layer lacks a capability and what to use instead, for the error (capability -> text).
    WHY_NOT: ClassVar[Mapping[type, str]] = {}

    # --- updates --------------------------------------------------------------------------
    def update(self, keys: jax.Array, values: jax.Array, positions: jax.Array) -> tuple[Self, KVView]:
        """Write ``[B, H_kv, T, D]`` at ``positions`` ``[B, T]``; see the module docstring."""
        return _as_entry_zero(self, type(self).update_entry, keys, values, positions)

    def update_entry(self, index, keys: jax.Array, values: jax.Array, positions: jax.Array) -> tuple[Self, KVView]:
        """``update`` of entry ``index`` of a stacked layer (leaves ``[L, ...]``), in place."""
        raise TypeError(
            f"{type(self).__name__} stores no attention K/V: feed it with update_state (Cache.update_state); "
            f"Cache.update feeds attention layers (full, sliding, chunked, hybrid)"
        )

    def attend_entry(self, index, queries, keys, values, positions, read: Callable) -> tuple[Self, jax.Array]:
        """``update_entry``, then attention of ``queries`` ``[B, H_q, T, D]`` over what it returned:
        ``read(queries, view, positions, query_weights)`` -> ``(output, slot mass or None)``
        (``jaxkv.attention.cached_attention`` supplies it). A layer that scores its slots by
        attention (``EvictingLayer``) asks ``read`` for the mass with its query weights; every
        other layer asks for none."""
        stack, view = self.update_entry(index, keys, values, positions)
        out, _ = read(queries, view, positions, None)
        return stack, out

    # --- entries of a stack -----------------------------------------------------------------
    def entry_view(self, index) -> Self:
        """Entry ``index`` (int or traced) of this stack as one layer, as an update reads it. A stack
        whose entries share storage (``EvictingLayer``'s paired budgets) gives each entry its slots."""
        return jax.tree.map(lambda leaf: entry(leaf, index), self)

    def store_entry(self, index, layer: Self) -> Self:
        """This stack with entry ``index`` replaced by ``layer`` (an ``entry_view`` updated), in place."""
        return jax.tree.map(lambda stack, new: stack.at[index].set(new), self, layer)

    def unstacked(self, index: int) -> Self:
        """Entry ``index`` (an int) as a single layer holding only its own slots, for inspection
        (``Cache.layer``); a copy, not for hot loops."""
        return jax.tree.map(lambda leaf: leaf[index], self)

    # --- edits, layout, footprint -----------------------------------------------------------
    @abc.abstractmethod
    def reset(self) -> Self:
        """Empty every row, keeping shapes."""

    @abc.abstractmethod
    def logical_axes(self) -> Self:
        """This (single, unstacked) layer with every array leaf replaced by the ``Axes`` naming its
        dimensions (``jaxkv.sharding``'s logical names), e.g. ``Axes("batch", "kv_heads",
        "kv_slots", "head_dim")`` for ``[B, H_kv, S, D]`` K/V; a mesh's rules map them to devices."""

    @property
    @abc.abstractmethod
    def max_length(self) -> int | None:
        """Longest sequence a row can hold before it overflows; None if unbounded."""

    @property
    def nbytes(self) -> int:
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(self))

    def describe(self) -> str:
        """The detail column of ``Cache``'s repr (span, rollback slots); '-' when there is none."""
        return "-"


def _as_entry_zero(layer: CacheLayer, entry_method: Callable, *args) -> tuple[CacheLayer, Any]:
    """``entry_method(stack, 0, *args)`` on ``layer`` as a stack of one; returns the layer and the result."""
    stack, result = entry_method(jax.tree.map(lambda leaf: leaf[None], layer), 0, *args)
    return jax.tree.map(lambda leaf: leaf[0], stack), result


# --- capabilities ----------------------------------------------------------------------------
class Capability(abc.ABC):
    """An optional part of the contract: a layer class has it by inheriting it, and the container
    asks the class (``has``), once per trace, before it calls the capability's methods."""

    ACTION: ClassVar[str]  # what a layer without it cannot do, for the error: "roll back"


def has(layer: CacheLayer, capability: type[Capability]) -> bool:
    """Whether ``layer``'s class has ``capability``: a check of the class, no cost at run time."""
    return issubclass(type(layer), capability)


def missing(layer: CacheLayer, capability: type[Capability]) -> str:
    """'EvictingLayer cannot roll back (no Rollback capability)', then the layer's ``WHY_NOT``, if any."""
    text = f"{type(layer).__name__} cannot {capability.ACTION} (no {capability.__name__} capability)"
    why = type(layer).WHY_NOT.get(capability)
    return f"{text}: {why}" if why else text


def require(layer: CacheLayer, capability: type[Capability], fix: str = "") -> None:
    """A ``TypeError`` (``missing``, then ``fix``) unless ``layer`` has ``capability``."""
    if not has(layer, capability):
        raise TypeError(missing(layer, capability) + (f"; {fix}" if fix else ""))


class Rollback(Capability):
    """Forget each row's last tokens (``Cache.rollback``: rejected drafts, an edited chat turn).

    The defaults serve storage that hides the slots at or past a row's length: ``rollback``
    shortens ``lengths``, and one call may undo the whole sequence.
    """

    ACTION = "roll back"

    def rollback(self, num_tokens: jax.Array | int) -> Self:
        """Forget the last ``num_tokens`` (int or ``[B]``) of each row; see ``limit_rollback``."""
        return self.replace(lengths=self.lengths - limit_rollback(self, num_tokens, self.lengths))

    @property
    def max_rollback(self) -> int | None:
        """Most tokens one ``rollback`` can undo; None if it can undo the whole sequence."""
        return None

    @property
    def rollback_budget(self) -> jax.Array | None:
        """``[B]`` (``[L, B]`` stacked) tokens each row can still undo, None when unbounded. A layer
        without a history of rollbacks: ``max_rollback`` per call."""
        return None if self.max_rollback is None else jnp.full(self.lengths.shape, self.max_rollback, jnp.int32)

    def rollback_hint(self, num_tokens: int) -> str:
        """How to build a cache that can undo ``num_tokens`` (for the rollback error): a ring's rule."""
        return (
            f"build the cache with rollback_slots >= {num_tokens - 1} (a ring of window + rollback_slots slots "
            f"undoes rollback_slots + 1)"
        )


class RowSelection(Capability):
    """Rows gathered (``Cache.reorder``, ``select``, ``repeat``, ``reorder_in_groups``: beams, samples)."""

    ACTION = "reorder, select or repeat rows"

    @abc.abstractmethod
    def gather_rows(self, indices: jax.Array) -> Self:
        """Rows ``indices`` ``[B']``: beam reorder, select and repeat."""

    def repeat_rows(self, num_repeats: int) -> Self:
        """Each row ``num_repeats`` times in a row (one prefilled prompt -> N beams or samples)."""
        return self.gather_rows(jnp.repeat(jnp.arange(self.lengths.shape[-1], dtype=jnp.int32), num_repeats))

    def gather_rows_in_groups(self, indices: jax.Array) -> Self:
        """Rows gathered within groups of ``K`` consecutive rows (the beams of one prompt):
        row ``g * K + k`` of the result is row ``g * K + indices[g, k]`` (``indices`` ``[G, K]``)."""
        return self.gather_rows(flat_group_indices(indices))


class Growth(Capability):
    """Storage that grows (``Cache.grow``, ``Cache.reserve``); a layer without it keeps its capacity."""

    ACTION = "grow"

    @abc.abstractmethod
    def grow(self, capacity: int) -> Self:
        """The layer with room for ``capacity`` tokens; never shrinks."""


class Eviction(Capability):
    """Cut to an ``EvictionSpec``'s budget by the scores the layer stored (``Cache.evict``)."""

    ACTION = "be cut to an eviction budget"

    @abc.abstractmethod
    def evict_to(self, spec, layer_indices: list[int], num_layers: int) -> CacheLayer:
        """This stack cut to ``spec``'s budget (see ``EvictingLayer.evict_to``)."""


class DepthBudgets(Capability):
    """Entries that differ by model depth (PyramidKV's budgets), set when the container stacks them."""

    ACTION = "keep a budget per depth"

    @abc.abstractmethod
    def for_layers(self, layer_indices: list[int], num_layers: int) -> Self:
        """This stack, entry j being model layer ``layer_indices[j]`` of ``num_layers``."""


class HeldTokens(Capability):
    """Hands its stored tokens to another cache (the source of a refill)."""

    ACTION = "hand its tokens to another cache"

    @abc.abstractmethod
    def held_entry(self, index) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Entry ``index``'s stored tokens in position order, to fill another cache with
        (``filled_from``): keys, values ``[B, H_kv, S, D]`` and positions ``[B, S]`` (-1: empty)."""


class HostMemory(Capability):
    """Keeps its K/V in host memory itself and brings to the device only what a step reads (page
    retrieval: the chosen pages), so the container places it there once (``Cache.from_config(...,
    offload=...)``) and never copies the layer to the device whole, as it does an offloaded
    layer without this capability (``jaxkv.offload``)."""

    ACTION = "read its K/V from host memory"

    @abc.abstractmethod
    def in_host_memory(self) -> Self:
        """This stack with its ``host_leaves`` in host memory, its reads and writes done there."""

    @abc.abstractmethod
    def host_leaves(self) -> Self:
        """This layer's structure with a bool per leaf: True where it lives in host memory."""


class Refill(Capability):
    """Filled from another cache's layer (the target of a refill)."""

    ACTION = "be refilled from another cache"

    def filled_from(self, source: CacheLayer, layer_indices: list[int], num_layers: int) -> Self:
        """This (empty) stack holding what ``source`` (the same model layers, from another cache)
        holds: each entry fed its source entry's tokens in one update (``HeldTokens``), so the
        K/V are stored as this layer stores them (quantized, in a ring). An evicting layer cuts
        them from an observer's scores instead (``EvictingLayer.filled_from``)."""
        require(
            source, HeldTokens, "refill from a cache whose layers hold every token: an Observer prefill "
            "(layer_builder=jaxkv.research.observer.Observer(...))"
        )  # fmt: skip
        # Mapped over the entries, not looped: one layer's update compiles once, whatever the depth.
        held = jax.vmap(lambda layer: jax.tree.map(lambda leaf: leaf[None], layer).held_entry(0))(source)
        return jax.vmap(lambda empty, tokens: empty.update(*tokens)[0])(self, held)


class LinearState(Capability):
    """A linear-attention state fed conv inputs (``Cache.update_state``; see ``jaxkv.layers.linear``)."""

    ACTION = "take update_state"

    def update_state(self, conv_inputs, positions, conv_fn: Callable, step_fn: Callable | None) -> tuple[Self, Any]:
        """``update_state_entry`` of a single layer."""
        return _as_entry_zero(self, type(self).update_state_entry, conv_inputs, positions, conv_fn, step_fn)

    @abc.abstractmethod
    def update_state_entry(self, index, conv_inputs, positions, conv_fn: Callable, step_fn: Callable | None):
        """Feed the state of entry ``index`` of a stacked layer; returns ``(layer, outputs)``."""


class Overflow(Capability):
    """A fixed capacity that a write under jit can run past (the tokens dropped, ``Cache.overflowed``)."""

    ACTION = "overflow"

    @property
    @abc.abstractmethod
    def overflowed(self) -> jax.Array:
        """``[B]`` bool: rows written past the storage under jit (tokens were dropped)."""


class ChunkLimit(Capability):
    """A limit on the tokens one update may bring (``Cache.exact_chunk_lengths``; speculative verification)."""

    ACTION = "limit an update's length"

    @abc.abstractmethod
    def exact_chunk_lengths(self) -> jax.Array | None:
        """``[B]`` (``[L, B]`` stacked): the most tokens the next update of each row may bring and
        still show every query what token-by-token decoding would; None when any number may."""


class BatchMajorLayer(CacheLayer, RowSelection):
    """A layer whose every array leaf is batch-major: rows are gathered leaf by leaf."""

    def gather_rows(self, indices: jax.Array) -> Self:
        """Rows ``indices`` ``[B']`` of every leaf: beam reorder, select and repeat."""
        indices = jnp.asarray(indices, jnp.int32)
        return jax.tree.map(lambda leaf: jnp.take(leaf, indices, axis=0), self)

    def repeat_rows(self, num_repeats: int) -> Self:
        """``RowSelection.repeat_rows`` as a broadcast: rows sharded over a mesh are repeated where they are."""

        def repeat(leaf: jax.Array) -> jax.Array:
            repeated = jnp.broadcast_to(leaf[:, None], (leaf.shape[0], num_repeats, *leaf.shape[1:]))
            return repeated.reshape(leaf.shape[0] * num_repeats, *leaf.shape[1:])

        return jax.tree.map(repeat, self)

    def gather_rows_in_groups(self, indices: jax.Array) -> Self:
        """``RowSelection.gather_rows_in_groups`` as a gather along each leaf's ``[G, K]`` row axes: rows
        sharded over a mesh by whole groups stay on their devices (no rows cross between them)."""
        groups, size = indices.shape

        def take(leaf: jax.Array) -> jax.Array:
            grouped = leaf.reshape(groups, size, *leaf.shape[1:])
            index = indices.reshape(groups, size, *(1,) * (leaf.ndim - 1))
            return jnp.take_along_axis(grouped, index, axis=1).reshape(leaf.shape)

        return jax.tree.map(take, self)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]


KV_AXES = Axes(BATCH, KV_HEADS, KV_SLOTS, HEAD_DIM)  # [B, H_kv, S, D]


class PositionalLayer(BatchMajorLayer, HeldTokens, Overflow):
    """Layers whose slot ``p`` holds position ``p`` (static and dynamic full attention, and the like).
    ``attention_backend``: what reads the queries (``jaxkv.kernels``; a layer that takes it as a
    field, ``StaticLayer``, hands it to a ``PositionalView``, with the mesh and rules the layer is
    sharded by, ``sharding``)."""

    attention_backend = XLA
    sharding = None

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]

    def logical_axes(self):
        return self.replace(keys=KV_AXES, values=KV_AXES, lengths=Axes(BATCH))

    def held_entry(self, index):
        lengths = entry(self.lengths, index)
        slot_index = jnp.arange(self.capacity, dtype=jnp.int32)[None, :]
        return entry(self.keys, index), entry(self.values, index), jnp.where(slot_index < lengths[:, None], slot_index, -1)

    def write(self, index, keys, values, positions):
        """Write tokens at slot = position in entry ``index``; return its whole buffer.

        Slots at or past a row's length hold nothing visible (``kv_positions`` -1), so
        tokens left behind by a rollback never leak.
        """
        slots = jnp.where(positions >= 0, positions, self.capacity)
        lengths = lengths_after(entry(self.lengths, index), positions)
        new = self.stored(index, keys, values, slots).replace(lengths=self.lengths.at[index].set(lengths))
        slot_index = jnp.arange(self.capacity, dtype=jnp.int32)[None, :]
        kv_positions = jnp.where(slot_index < lengths[:, None], slot_index, -1)
        used = jnp.minimum(jnp.max(lengths), self.capacity)
        mask_info = MaskInfo(kv_positions, slots_used=used)
        if self.attention_backend == XLA:
            return new, KVView(new.keys, new.values, index, mask_info)
        return new, PositionalView(
            new.keys, new.values, index, mask_info, lengths, self.attention_backend, self.sharding
        )  # fmt: skip

    def stored(self, index, keys, values, slots) -> Self:
        """This layer with ``keys``/``values`` ``[B, H_kv, T, D]`` written into entry ``index`` at
        ``slots`` ``[B, T]`` (``write_slots``: one outside ``[0, S)`` dropped)."""
        return self.replace(
            keys=write_slots(self.keys, index, keys, slots), values=write_slots(self.values, index, values, slots)
        )

    @property
    def overflowed(self) -> jax.Array:
        """``[B]`` bool: rows written past the buffer under jit (those tokens were dropped)."""
        return self.lengths > self.capacity

    def reset(self):
        return jax.tree.map(jnp.zeros_like, self)


@pytree_class
class RowPacking:
    """Where the serving engine's packed tokens go in a per-row layout: token i (of engine row
    ``rows[i]``, at ``positions[i]``) is token ``order[i]`` of its row, counted from the row's
    first position in the update (``starts``); ``[N, ...]`` <-> ``[R, T, ...]``, padding (a
    negative position) nowhere."""

    rows: jax.Array  # [N] int32
    order: jax.Array  # [N] int32, T for padding (dropped when unpacked)
    real: jax.Array  # [N] bool
    starts: jax.Array  # [R] int32: each row's first position in the update, -1 for a row without tokens
    num_rows: int = struct.field(pytree_node=False)
    tokens_per_row: int = struct.field(pytree_node=False)

    @classmethod
    def of(cls, rows, positions, num_rows: int, tokens_per_row: int) -> RowPacking:
        """``rows``, ``positions`` ``[N]`` of ``num_rows`` engine rows; a row's tokens are consecutive
        positions from its first one (in any order among the N)."""
        real = positions >= 0
        none = jnp.iinfo(jnp.int32).max
        first = jnp.full(num_rows, none, jnp.int32).at[rows].min(jnp.where(real, positions, none).astype(jnp.int32))
        starts = jnp.where(first == none, -1, first)
        order = jnp.where(real, positions - starts[rows], tokens_per_row)
        return cls(rows, order, real, starts, num_rows, tokens_per_row)

    def unpacked(self, x: jax.Array, fill) -> jax.Array:
        """``[N, ...]`` -> ``[R, T, ...]``, ``fill`` where a row has no token."""
        dense = jnp.full((self.num_rows, self.tokens_per_row, *x.shape[1:]), fill, x.dtype)
        return dense.at[self.rows, self.order].set(x, mode="drop")

    def packed(self, x: jax.Array) -> jax.Array:
        """``[R, T, ...]`` -> ``[N, ...]``, zeros at padding."""
        found = x[self.rows, jnp.clip(self.order, 0, self.tokens_per_row - 1)]
        return jnp.where(self.real.reshape(-1, *[1] * (found.ndim - 1)), found, 0)


class PackedRowsLayer(CacheLayer):
    """A per-row layer held for the serving engine: ``slots`` keeps one row per engine row (the
    request that holds the row), and an update brings ``[1, N]`` packed tokens of many rows,
    token i of row ``packed.token_rows[i]`` (a ``jaxkv.batch.PackedBatch``, an argument of the
    step, never stored here). Subclasses lay the tokens out ``[R, T]`` (``packing``), run their
    storage there and pack the outputs again.

    Each row that has tokens in an update starts from its first position there (``_started``):
    a row whose tokens start at position 0 starts empty, so a request that takes over a row (or
    is computed again after a preemption) never sees what the row's previous request left; a
    layer that rolls back by position (``PackedStateLayer``) also takes a row back to a first
    position below its length (the engine's rejected drafts); in the others a row that starts
    above 0 must continue from its length. What a row holds cannot be rebuilt from cached pages,
    so the engine serves a model with these layers without prefix caching, and ``Cache.rollback``
    cannot undo their tokens.

    Subclasses declare the field ``slots``.
    """

    slots: CacheLayer

    WHY_NOT = {
        Rollback: "what an engine row holds cannot be rebuilt from cached pages; the engine serves these layers "
        "without rollback",
        RowSelection: "its rows are the serving engine's rows, each held by one request",
    }

    @property
    def lengths(self) -> jax.Array:
        return self.slots.lengths

    @property
    def max_length(self) -> None:
        return None

    def packing(self, index, positions: jax.Array, packed) -> tuple[CacheLayer, RowPacking]:
        """Where the update's packed tokens (``positions`` ``[N]``, rows ``packed.token_rows``) go in
        ``[R, T]``, and ``slots`` with entry ``index``'s rows set to start there (``_started``)."""
        packing = RowPacking.of(packed.token_rows, positions, self.lengths.shape[1], packed.tokens_per_row)
        current = self._started(self.slots.entry_view(index), packing.starts)
        return self.slots.store_entry(index, current), packing

    def _started(self, current: CacheLayer, starts: jax.Array) -> CacheLayer:
        """One entry of ``slots`` (``current``, R rows) with the rows whose first position in the
        update (``starts`` ``[R]``, -1 for a row without tokens) is 0 emptied."""

        def emptied(now: jax.Array, empty: jax.Array) -> jax.Array:
            return jnp.where((starts == 0).reshape(-1, *[1] * (now.ndim - 1)), empty, now)

        return jax.tree.map(emptied, current, current.reset())

    def reset(self) -> Self:
        return self.replace(slots=self.slots.reset())

    def logical_axes(self) -> Self:
        return self.replace(slots=self.slots.logical_axes())

    def describe(self) -> str:
        return self.slots.describe()


def describe_extent(rollback_slots: int, **span: int | None) -> str:
    """``describe`` of a layer with an optional span (``window=4``) and rollback slots (``R=2``)."""
    parts = [f"{name}={value}" for name, value in span.items() if value]
    parts += [f"R={rollback_slots}"] if rollback_slots else []
    return " ".join(parts) or "-"


def flat_group_indices(indices: jax.Array) -> jax.Array:
    """``[G, K]`` row indices within groups of K rows -> the ``[G * K]`` absolute rows they name."""
    groups, size = indices.shape
    return (indices + size * jnp.arange(groups, dtype=jnp.int32)[:, None]).reshape(-1)


def is_traced(*xs) -> bool:
    """True when any value is abstract (inside jit/scan): data-dependent checks must wait."""
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def lengths_after(lengths: jax.Array, positions: jax.Array) -> jax.Array:
    """Row lengths after writing ``positions`` ``[B, T]`` (negative = padding)."""
    return jnp.maximum(lengths, jnp.max(positions, axis=1).astype(jnp.int32) + 1)


def stacked_for_layers(layer: CacheLayer, layer_indices: list[int], num_layers: int) -> CacheLayer:
    """``layer`` repeated as a stack (every leaf ``[L, ...]``), entry j model layer ``layer_indices[j]``
    of ``num_layers`` (a layer with ``DepthBudgets`` sets what differs by depth)."""
    count = len(layer_indices)
    repeated = jax.tree.map(lambda leaf: jnp.broadcast_to(leaf, (count, *leaf.shape)), layer)
    return repeated.for_layers(layer_indices, num_layers) if has(layer, DepthBudgets) else repeated


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


def check_array(caller: str, what: str, x: jax.Array, layout: tuple[str, ...], expected: tuple, dtype, fix: str = ""):
    """``x`` must have the ``expected`` shape (None: any size along that axis of ``layout``, e.g.
    ``("B", "H_kv", "T", "D")``) and ``dtype``, the cache's; the errors name ``caller``, ``what``
    was passed and, after the shape error, ``fix``."""
    if x.ndim != len(expected) or any(want is not None and size != want for size, want in zip(x.shape, expected)):
        sizes = ", ".join(name if want is None else str(want) for name, want in zip(layout, expected))
        raise ValueError(
            f"{caller}: {what} has shape {tuple(x.shape)}, expected [{', '.join(layout)}] = [{sizes}] as the "
            f"cache was built{fix}"
        )
    if x.dtype != dtype:
        raise TypeError(
            f"{caller}: {what} dtype {x.dtype} differs from the cache dtype {dtype}; cast them or build the cache "
            f"with dtype={x.dtype}"
        )


def check_update_inputs(stack, index, keys: jax.Array, values: jax.Array, positions) -> jax.Array:
    """Shape and dtype checks (always, at trace time) and position checks (eagerly) for an
    update of entry ``index`` of a stacked layer whose ``keys`` are ``[L, B, H_kv, S, D]``.
    Returns the positions as int32."""
    caller = f"{type(stack).__name__}.update"
    _, batch, heads, _, dim = stack.keys.shape
    for what, x in (("keys", keys), ("values", values)):
        check_array(caller, what, x, ("B", "H_kv", "T", "D"), (batch, heads, None, dim), stack.keys.dtype)
    if keys.shape != values.shape:
        raise ValueError(f"{caller}: keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
    return check_positions(caller, positions, (keys.shape[0], keys.shape[2]), stack.lengths, index)


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
    """Eager errors for a rollback request (int or ``[B]``): a negative count, any count of a
    layer without ``Rollback``, or more than ``layer.max_rollback``; nothing when traced."""
    if is_traced(num_tokens):
        return
    n, name = np.asarray(num_tokens), type(layer).__name__
    if np.any(n < 0):
        raise ValueError(f"{name}.rollback: cannot roll back a negative count {n.tolist()}")
    if not has(layer, Rollback):
        if np.any(n > 0):
            raise ValueError(missing(layer, Rollback))
        return
    most = layer.max_rollback
    if most is not None and np.any(n > most):
        raise ValueError(
            f"{name}.rollback: asked to undo {np.max(n)} tokens but the layer can undo at most {most}; "
            f"{layer.rollback_hint(int(np.max(n)))}"
        )


def check_budget(layer, budget: jax.Array, num_tokens: jax.Array) -> None:
    """Eagerly, an error naming the first row asked to undo more than its ``budget`` ``[B]``."""
    if is_traced(budget, num_tokens):
        return
    over = np.flatnonzero(np.asarray(num_tokens) > np.asarray(budget))
    if over.size:
        row = int(over[0])
        raise ValueError(
            f"{type(layer).__name__}.rollback: row {row} can undo only {max(int(budget[row]), 0)} more token(s): "
            f"rollbacks without a feed in between share one budget of {layer.max_rollback}; feed tokens between "
            f"rollbacks, or build the cache with a larger rollback_slots"
        )


def limit_rollback(layer, num_tokens, lengths: jax.Array) -> jax.Array:
    """``num_tokens`` (int or ``[B]``) as the ``[B]`` counts every row of ``layer`` (a single layer,
    or every entry of a stacked one) can undo, the rows being ``lengths`` ``[B]`` long.

    Eagerly, a negative count, more than ``max_rollback`` or more than a row's
    ``rollback_budget`` is an error naming the fix. Under jit the count is clipped to
    ``[0, length]`` and to the row's budget instead: the documented clamp (to 0 for a layer
    without ``Rollback``). The count becomes an array first, so that under jit even a constant
    is clamped rather than checked.
    """
    num_tokens = jnp.asarray(num_tokens, jnp.int32)
    check_rollback(layer, num_tokens)
    n = jnp.clip(jnp.broadcast_to(num_tokens, lengths.shape), 0, lengths)
    if not has(layer, Rollback):
        return jnp.zeros_like(n)
    budget = layer.rollback_budget
    if budget is None:
        return n
    budget = jnp.min(budget.reshape(-1, lengths.shape[0]), axis=0)  # stacked: each row's tightest entry
    check_budget(layer, budget, n)
    return jnp.minimum(n, jnp.maximum(budget, 0))


def ring_rollback_budget(slot_positions: jax.Array, lengths: jax.Array, max_rollback: int) -> jax.Array:
    """``[B]`` (``[L, B]`` stacked) tokens a ring row can still undo.

    After undoing n tokens the next query needs the keys before position ``length - n``; the
    ring holds the last N positions below its high water, the furthest position written plus
    one (the largest of ``slot_positions`` ``[B, N]``: a re-fed position lands on its own slot).
    So ``max_rollback`` counts from the high water, and rollbacks without a feed in between
    share it.
    """
    high_water = jnp.max(slot_positions, axis=-1) + 1
    return max_rollback - jnp.maximum(high_water - lengths, 0)


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
