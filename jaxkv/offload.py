"""Offloaded cache layers: the K/V of chosen layers lives in host memory and comes to the
device one layer at a time (``Cache.from_config(..., offload=...)``).

Where things live. A stacked group's K/V leaves (every leaf with a ``kv_heads`` axis: keys and
values, quantized codes, scales and residuals) sit in host memory (JAX's ``pinned_host``
memory kind); its bookkeeping (row lengths, a ring's slot positions) stays on the device,
where every step reads it. An update of layer i runs on a window: entry i of every leaf as a
one-entry stack ``[1, ...]`` on the device. Inside a model's forward (``Cache.with_prefetch``)
the window was fetched by the previous step, and while layer i computes, layer i - 1's updated
window is written back into the host stack (a dynamic-update-slice of one entry) and then
entry i + 1 is fetched (a dynamic slice of one entry): neither waits for layer i (``Prefetch``
holds the two windows between steps). The fetch follows the write because XLA copies the
whole stack when one loop step reads a buffer and then updates it in place. All of it happens
inside the compiled layer scan: no Python per layer. The transfers are ``jax.device_put`` to
``jax.memory.Space`` inside the traced function, which XLA lowers to one host-to-device and
one device-to-host copy of one layer per step of the scan.

Which layers (``offload``): ``True`` offloads ``DEFAULT_OFFLOAD``, the layer types whose K/V
grows with the sequence (full attention, and the attention half of a hybrid layer). Sliding
and chunked rings stay on the device by default: a ring holds a fixed window (Gemma 3: 512
tokens against a context of up to 32k), so offloading it saves little memory and would still
copy the whole ring in and out at every step. ``"all"`` offloads every layer that stores
K/V; a layer type name, or a list of names and layer indices, chooses exactly. A stacked
cache stores the repeats of its layer pattern in one stack, so indices must cover whole
groups. Linear-attention states (``linear_attention``, ``conv``) have no K/V to offload.

On the CPU backend both memory kinds are the same RAM: the tests there pin where each leaf
lives, which copies the traced program asks for, and that the tokens match a resident cache;
what the copies cost needs an accelerator (``scripts/bench_offload.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on

from jaxkv.protocol import CacheLayer, pytree_class
from jaxkv.sharding import KV_HEADS, Axes

HOST_MEMORY = "pinned_host"  # the memory kind offloaded K/V lives in
DEFAULT_OFFLOAD = ("full_attention", "hybrid")  # offload=True: the layer types whose K/V grows with the sequence
ALL = "all"


@pytree_class
class Prefetch:
    """An offloaded group's entries on the device during a forward (``Cache.with_prefetch``):
    ``ready``, the entry its next update reads; ``written``, the entry its last update produced,
    which goes back to the host stack at ``index`` when the next update starts (or at
    ``Cache.without_prefetch``). Each ``[1, ...]``: two layers in flight per group."""

    ready: CacheLayer
    written: CacheLayer
    index: jax.Array  # int32 scalar


def offloaded_layers(offload, layer_types: Sequence[str]) -> list[int]:
    """The model layers ``offload`` names (before grouping; see the module docstring):
    None or False: none; True: the ``DEFAULT_OFFLOAD`` types; ``"all"``; a layer type; or a
    list of layer types and layer indices. Errors name ``offload`` and what it may hold."""
    if offload is None or offload is False:
        return []
    types = sorted(set(layer_types))
    if offload is True:
        chosen = [i for i, kind in enumerate(layer_types) if kind in DEFAULT_OFFLOAD]
        if not chosen:
            raise ValueError(
                f"offload=True offloads the {list(DEFAULT_OFFLOAD)} layers and this cache has none (its layer "
                f"types: {types}): name the layer types to offload, or 'all'"
            )
        return chosen
    if offload == ALL:
        return list(range(len(layer_types)))
    items = [offload] if isinstance(offload, str) else list(offload)
    chosen = set()
    for item in items:
        if isinstance(item, str):
            if item not in types:
                raise ValueError(f"offload names layer type {item!r}, but this cache's layer types are {types}")
            chosen |= {i for i, kind in enumerate(layer_types) if kind == item}
        elif isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            if not 0 <= item < len(layer_types):
                raise ValueError(f"offload names layer {item}, but this cache has layers 0..{len(layer_types) - 1}")
            chosen.add(int(item))
        else:
            raise TypeError(
                f"offload takes True, {ALL!r}, a layer type or a list of layer types and layer indices; got {item!r}"
            )
    return sorted(chosen)


def offloaded_groups(layers: Sequence[int], num_layers: int, period: int) -> tuple[int, ...]:
    """The groups holding ``layers`` (group g stores layers g, g + period, ...); an error when
    ``layers`` covers part of a group: a stack lives in one memory."""
    chosen = set(layers)
    groups = []
    for g in range(period):
        members = set(range(g, num_layers, period))
        if members & chosen and not members <= chosen:
            raise ValueError(
                f"offload covers layers {sorted(members & chosen)} of group {g}, which stacks layers "
                f"{sorted(members)} (the repeats of the layer pattern, scanned together): offload all of them or none"
            )
        if members <= chosen:
            groups.append(g)
    return tuple(groups)


def kv_leaves(axes: CacheLayer) -> CacheLayer:
    """Per leaf of a layer whose leaves are its logical ``axes`` (``CacheLayer.logical_axes``):
    True where it holds K/V (a ``kv_heads`` axis), which an offloaded group keeps on the host."""
    return jax.tree.map(lambda leaf_axes: KV_HEADS in leaf_axes, axes, is_leaf=lambda x: isinstance(x, Axes))


def moved(tree, host: CacheLayer, space: jax.memory.Space):
    """``tree`` with its ``host`` leaves (a ``kv_leaves`` mask) moved to ``space``; eagerly a
    copy, inside jit a transfer of exactly those arrays."""
    return jax.tree.map(lambda leaf, on_host: jax.device_put(leaf, space) if on_host else leaf, tree, host)


def fetch(stack: CacheLayer, index, host: CacheLayer) -> CacheLayer:
    """Entry ``index`` (int or traced) of ``stack`` (leaves ``[L, ...]``) as a one-entry stack
    ``[1, ...]`` on the device: one layer's K/V copied from the host."""
    window = jax.tree.map(lambda leaf: jax.lax.dynamic_slice_in_dim(leaf, index, 1, axis=0), stack)
    return moved(window, host, jax.memory.Space.Device)


def store(stack: CacheLayer, index, window: CacheLayer, host: CacheLayer) -> CacheLayer:
    """``stack`` with entry ``index`` replaced by ``window`` ``[1, ...]`` (its K/V copied to the
    host first): an in-place update of one entry of each leaf."""
    window = moved(window, host, jax.memory.Space.Host)
    return jax.tree.map(lambda leaf, new: jax.lax.dynamic_update_slice_in_dim(leaf, new, index, axis=0), stack, window)


def map_entries(fn: Callable[[CacheLayer], CacheLayer], stack: CacheLayer, host: CacheLayer) -> CacheLayer:
    """``fn`` (single layer -> single layer, shapes may change: a reorder to fewer rows, a
    repeat, a grow) applied to every entry of an offloaded ``stack``, one entry on the device
    at a time, into a new stack whose K/V is on the host again."""
    count = jax.tree.leaves(stack)[0].shape[0]

    def on_device(i, stack) -> CacheLayer:
        return fn(jax.tree.map(lambda leaf: leaf[0], fetch(stack, i, host)))

    shapes = jax.eval_shape(on_device, 0, stack)  # of one result layer (computed on the device)
    empty = jax.tree.map(lambda s: jnp.zeros((count, *s.shape), s.dtype), shapes)
    empty = moved(empty, host, jax.memory.Space.Host)

    def one(i, out):
        return store(out, i, jax.tree.map(lambda leaf: leaf[None], on_device(i, stack)), host)

    return jax.lax.fori_loop(0, count, one, empty)


def host_rows(stack: jax.Array, coords: jax.Array) -> jax.Array:
    """The vectors ``stack[c_0, ..., c_{n-2}]`` of a host-memory ``stack`` ``[..., D]`` at each of
    ``coords`` ``[..., n - 1]`` (int32, clipped into range): ``[..., D]`` on the device. The gather
    runs in host memory (XLA's host compute), so only the rows taken cross to the device."""
    flat = jnp.clip(coords.reshape(-1, coords.shape[-1]), 0, jnp.asarray(stack.shape[:-1]) - 1)
    found = _in_host_memory(_take_rows, stack, flat)
    return jax.device_put(found, jax.memory.Space.Device).reshape(*coords.shape[:-1], stack.shape[-1])


def host_rows_set(stack: jax.Array, coords: jax.Array, new: jax.Array) -> jax.Array:
    """A host-memory ``stack`` ``[..., D]`` with the vectors at ``coords`` ``[K, n - 1]`` set to
    ``new`` ``[K, D]`` (a coordinate out of range: dropped), written in host memory: only ``new``
    crosses."""
    return _in_host_memory(_set_rows, stack, coords, new.astype(stack.dtype))


def _take_rows(stack: jax.Array, coords: jax.Array) -> jax.Array:
    return stack.at[tuple(coords.T)].get(mode="promise_in_bounds")


def _set_rows(stack: jax.Array, coords: jax.Array, new: jax.Array) -> jax.Array:
    return stack.at[tuple(coords.T)].set(new, mode="drop")


@functools.partial(jax.jit, static_argnums=0)
def _in_host_memory(fn: Callable, *args):
    """``fn(*args)`` computed by XLA in host memory (``compute_on('device_host')``), every argument
    moved there first (a no-op for one already there); the result stays there. Jitted, so that an
    eager call traces it as a step does. ``fn`` must create no index constants of its own next to
    a host argument (JAX places a constant in device memory): ``_take_rows``' clip and
    ``_set_rows``' drop index with the given rows alone."""
    args = [jax.device_put(arg, jax.memory.Space.Host) for arg in args]
    return compute_on("device_host")(jax.jit(fn))(*args)


def on_host(leaf: jax.Array) -> bool:
    """Whether a (concrete) array lives in a host memory kind."""
    return leaf.sharding.memory_kind in ("pinned_host", "unpinned_host")
