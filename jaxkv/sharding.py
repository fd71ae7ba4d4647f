"""Sharding over a device mesh: logical axis names for every array, and rules that map them to
mesh axes (the way MaxText and jax-llm-examples do).

Every cache leaf and every weight names its axes with the logical names below (a cache layer's
``logical_axes``, a model module's ``param_axes``); a ``Layout`` (a ``Mesh`` plus ``rules``, logical
name -> mesh axis or None) turns those names into a ``NamedSharding`` for an array of a given
shape. The default rules are tensor parallel over ``model`` (query and K/V heads, the MLP
hidden dimension, the vocabulary) and data parallel over ``data`` (batch rows, the engine's
pages).

Divisibility: a mesh axis shards a dimension only when its size divides the dimension's units
(heads for a flattened ``heads x head_dim`` dimension, else the dimension itself). Batch rows
and pages must divide (``MUST_DIVIDE``): otherwise every device would need the whole batch, so
that is an error naming the axis and the sizes. Any other axis that does not divide is
replicated, with one warning that says so (SmolLM2's 3 K/V heads or Gemma 3 270M's one on a
``model`` axis of 2, 4 or 8).

Arrays are created sharded, never built on one device first: ``Layout.place`` hands each
device its slice of a host array (``jax.make_array_from_callback``), which also works across
processes (``jax.distributed``), and caches are allocated by a jitted zeros with
``out_shardings`` (``Cache.from_config(mesh=...)``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Logical axes. A cache leaf or a weight names each of its dimensions with one of these (or None).
LAYERS = "layers"  # the stack of same-kind layers (a scanned model's leading axis)
BATCH = "batch"  # rows of a batch, or of the engine's block table
KV_HEADS = "kv_heads"  # K/V heads (a flattened K/V-heads x head_dim weight dimension too)
Q_HEADS = "q_heads"  # query heads (a flattened heads x head_dim weight dimension)
HEAD_DIM = "head_dim"  # the channels of one head (packed codes or scale groups when quantized)
KV_SLOTS = "kv_slots"  # a row's token slots (a buffer's positions, a ring's slots)
PAGES = "pages"  # pages of a paged pool
PAGE_SLOTS = "page_slots"  # the token slots of one page
TABLE = "table"  # block-table columns (a row's logical pages)
TOKENS = "tokens"  # the tokens one engine step packs
STATE = "state"  # linear-attention state: conv channels, state slots and recurrent state dimensions
EMBED = "embed"  # the model (residual stream) dimension
MLP = "mlp"  # the MLP hidden dimension
VOCAB = "vocab"  # the vocabulary
LINEAR_PROJ = "linear_proj"  # linear-attention (gated DeltaNet) projections' outputs
LOGICAL_AXES = (
    LAYERS, BATCH, KV_HEADS, Q_HEADS, HEAD_DIM, KV_SLOTS, PAGES, PAGE_SLOTS, TABLE, TOKENS, STATE, EMBED, MLP,
    VOCAB, LINEAR_PROJ,
)  # fmt: skip

DATA, MODEL = "data", "model"
DEFAULT_RULES: Mapping[str, str | None] = {
    BATCH: DATA,
    PAGES: DATA,
    KV_HEADS: MODEL,
    Q_HEADS: MODEL,
    MLP: MODEL,
    VOCAB: MODEL,
}
# Sharding these is the point of data parallelism: a batch that cannot be split is an error.
MUST_DIVIDE = frozenset({BATCH, PAGES})

Axes = PartitionSpec  # logical names per dimension (a pytree leaf, unlike a plain tuple)


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}``; errors name what is wrong."""
    shape = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().isdigit() or int(size) <= 0:
            raise ValueError(f"mesh {text!r}: expected comma-separated axis=size (e.g. data=2,model=4), got {part!r}")
        if name.strip() in shape:
            raise ValueError(f"mesh {text!r}: axis {name.strip()!r} is given twice")
        shape[name.strip()] = int(size)
    if not shape:
        raise ValueError(f"mesh {text!r}: give at least one axis, e.g. data=2,model=4")
    return shape


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of ``shape`` (axis name -> size; sizes multiply to the device count) over
    ``devices`` (default: every device of every process), axes in auto sharding mode."""
    devices = list(jax.devices() if devices is None else devices)
    size = math.prod(shape.values())
    if size != len(devices):
        axes = ", ".join(f"{name}={n}" for name, n in shape.items())
        raise ValueError(
            f"mesh {axes} has {size} devices but {len(devices)} are available; the axis sizes must multiply to "
            f"{len(devices)} (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N or JAX_NUM_CPU_DEVICES "
            f"for N host devices)"
        )
    grid = np.asarray(devices, dtype=object).reshape(tuple(shape.values()))
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    return Mesh(grid, tuple(shape), axis_types=auto)


def check_rules(rules: Mapping[str, str | None], mesh: Mesh) -> None:
    """Every rule maps a known logical axis to an axis of ``mesh`` (or None)."""
    unknown = sorted(set(rules) - set(LOGICAL_AXES))
    if unknown:
        raise ValueError(f"sharding rules name unknown logical axes {unknown}; known: {sorted(LOGICAL_AXES)}")
    bad = sorted({axis for axis in rules.values() if axis is not None and axis not in mesh.shape})
    if bad:
        raise ValueError(f"sharding rules use mesh axes {bad} that the mesh lacks; its axes: {list(mesh.shape)}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the rules that map logical axes onto it (``DEFAULT_RULES`` updated by
    ``rules``; a logical axis mapped to None is replicated). Hashable: it is static under jit."""

    mesh: Mesh
    rules: tuple[tuple[str, str | None], ...] = tuple(DEFAULT_RULES.items())

    @classmethod
    def create(cls, mesh: Mesh, rules: Mapping[str, str | None] | None = None) -> Layout:
        merged = {**DEFAULT_RULES, **(rules or {})}
        check_rules(merged, mesh)
        return cls(mesh, tuple(sorted(merged.items())))

    def mesh_axis(self, logical: str | None) -> str | None:
        return None if logical is None else dict(self.rules).get(logical)

    def spec(
        self, axes: Axes, shape: Sequence[int], units: Mapping[str, int] | None = None, *, quiet: bool = False
    ) -> PartitionSpec:
        """The mesh ``PartitionSpec`` of an array of ``shape`` whose dimensions are named ``axes``.

        ``units``: how many indivisible units a logical axis holds where that is not the
        dimension's size (a flattened heads x head_dim weight dimension: the heads).
        ``quiet``: replicate what does not divide without an error or a warning (activations: the
        serving engine packs its batch into one row)."""
        if len(axes) != len(shape):
            raise ValueError(f"logical axes {tuple(axes)} name {len(axes)} dimensions of an array of shape {shape}")
        used, spec = set(), []
        for logical, size in zip(axes, shape):
            axis = self.mesh_axis(logical)
            if axis is None or axis in used or self.mesh.shape[axis] == 1:
                spec.append(None)
                continue
            count = (units or {}).get(logical, size)
            if count % self.mesh.shape[axis] == 0 and size % self.mesh.shape[axis] == 0:
                used.add(axis)
                spec.append(axis)
                continue
            message = f"{logical} ({count}) is not divisible by mesh axis {axis!r} of size {self.mesh.shape[axis]}"
            if quiet:
                spec.append(None)
                continue
            if logical in MUST_DIVIDE:
                raise ValueError(f"{message}: make it a multiple of {self.mesh.shape[axis]}, or shrink the axis")
            warn_once(f"{message}: it is replicated on every {axis!r} device")
            spec.append(None)
        return PartitionSpec(*spec)

    def sharding(
        self, axes: Axes, shape: Sequence[int], units: Mapping[str, int] | None = None, *, quiet: bool = False
    ) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape, units, quiet=quiet))

    def shardings(self, axes_tree, shapes_tree):
        """``NamedSharding`` per leaf of ``shapes_tree`` (arrays or ``ShapeDtypeStruct``s), from
        the matching ``Axes`` leaf of ``axes_tree``."""
        return jax.tree.map(
            lambda axes, leaf: self.sharding(axes, leaf.shape),
            axes_tree,
            shapes_tree,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    def place(self, array, axes: Axes, units: Mapping[str, int] | None = None) -> jax.Array:
        """``array`` (host or device) as a global array sharded by ``axes``: each device gets its
        slice straight from the host copy (every process passes the same values)."""
        sharding = self.sharding(axes, np.shape(array), units)
        if isinstance(array, jax.Array) and (array.sharding == sharding or not array.is_fully_addressable):
            return jax.device_put(array, sharding)  # a global array already: at most a reshard
        host = np.asarray(array)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """A ``UserWarning`` the first time ``message`` comes up in this process (a cache constrains
    itself at every update, so the same replication would otherwise be reported per layer)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=4)


def with_layers(axes_tree):
    """``axes_tree`` of one layer with the leading ``layers`` axis of a stack prepended."""
    return jax.tree.map(lambda axes: Axes(LAYERS, *axes), axes_tree, is_leaf=lambda x: isinstance(x, PartitionSpec))


def constrain(tree, shardings):
    """``tree`` constrained to ``shardings`` (inside jit an annotation, eagerly a reshard if needed)."""
    return jax.lax.with_sharding_constraint(tree, shardings)


def device_bytes(tree) -> dict[jax.Device, int]:
    """Bytes each addressable device holds of ``tree``'s arrays (from ``addressable_shards``)."""
    held: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def to_host(x: jax.Array) -> np.ndarray:
    """A global array as one host array on every process (gathered when other processes hold parts)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
