"""Print the K/V cache bytes each device holds when a cache is sharded over a device mesh.

    python scripts/sharding_table.py --batch 64 --max-length 32768 --meshes 1x8,2x4,4x2,8x1

For SmolLM2-135M and Gemma 3 270M (their configs as ``Pretrained(name).model()`` reads them; the
float32 weights stay memory-mapped), a static cache of ``--batch`` rows of ``--max-length`` tokens
and paged pools holding the same tokens, on meshes ``data x model`` under the default rules
(``jaxkv.sharding.DEFAULT_RULES``). Nothing is allocated: the caches are shapes
(``jax.eval_shape``), and each leaf's share of a device is its ``NamedSharding.shard_shape``.
The script gives JAX as many CPU devices as the largest mesh needs; shapes need no accelerator.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
import warnings
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxkv.cache import Cache, layer_types_of
from jaxkv.layers.paged import Paging
from jaxkv.models.gemma3 import Gemma3Config
from jaxkv.models.llama import LlamaConfig
from jaxkv.models.load import Pretrained
from jaxkv.sharding import DATA, KV_HEADS, MODEL, PAGES, Layout, make_mesh
from jaxkv.sizing import human_bytes

MODELS = {"SmolLM2-135M": "smollm2", "Gemma 3 270M": "gemma3"}
DTYPES = (jnp.bfloat16, jnp.float32)
AttentionConfig = LlamaConfig | Gemma3Config  # the tabled models' configs: full and sliding attention layers


@dataclasses.dataclass(frozen=True)
class Share:
    """A sharded cache's bytes: all devices together and on each one (every device holds the
    same share: a mesh axis only shards what it divides), over all leaves and over the K/V
    leaves alone (those with a ``kv_heads`` axis; the rest is lengths, positions and block
    tables). ``kv_heads_split``: the K/V heads are divided over their mesh axis;
    ``replicated``: dimensions the rules map onto a mesh axis that they do not divide, kept whole
    on each of its devices (what ``jaxkv.sharding`` warns about), e.g. ``kv_heads (3) on model=4``."""

    total: int
    per_device: int
    kv_total: int
    kv_per_device: int
    kv_heads: int
    kv_heads_split: bool
    replicated: tuple[str, ...]


def cache_share(
    config,
    batch_size: int,
    mesh: Mesh,
    *,
    max_length: int,
    dtype,
    paging: Paging | None = None,
    rules: Mapping[str, str | None] | None = None,
) -> Share:
    """The ``Share`` of a model's cache (``config``: a model config or a dict, as
    ``Cache.from_config`` reads it; stacked, as models build it) sharded over ``mesh``,
    computed from shapes only. The replication warnings are not shown: ``replicated`` says it."""
    options = {"max_length": max_length, "dtype": dtype, "stacked": True, "paging": paging}

    def build() -> Cache:
        return Cache.from_config(config, batch_size, mesh=mesh, rules=rules, **options)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = jax.eval_shape(build)
        shardings = jax.tree.leaves(cache.shardings())
    axes = jax.tree.leaves(cache.logical_axes(), is_leaf=lambda x: isinstance(x, PartitionSpec))
    total = per_device = kv_total = kv_per_device = kv_heads = 0
    kv_heads_split, replicated = False, []
    for leaf, leaf_axes, sharding in zip(jax.tree.leaves(cache), axes, shardings, strict=True):
        whole = leaf.size * leaf.dtype.itemsize
        held = math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        total, per_device = total + whole, per_device + held
        replicated += kept_whole(cache.layout, tuple(leaf_axes), leaf.shape, sharding.spec)
        if KV_HEADS in tuple(leaf_axes):
            heads_dim = tuple(leaf_axes).index(KV_HEADS)
            kv_total, kv_per_device, kv_heads = kv_total + whole, kv_per_device + held, leaf.shape[heads_dim]
            kv_heads_split |= sharding.spec[heads_dim] is not None
    return Share(total, per_device, kv_total, kv_per_device, kv_heads, kv_heads_split, tuple(dict.fromkeys(replicated)))


def kept_whole(layout: Layout, axes: tuple, shape: Sequence[int], spec: PartitionSpec) -> list[str]:
    """The dimensions of an array (logical ``axes``, ``shape``, mesh ``spec``) that ``layout``'s
    rules map onto a mesh axis of more than one device but that stay whole, e.g. ``kv_heads (3) on model=4``."""
    whole = []
    for logical, size, mesh_axis in zip(axes, shape, spec, strict=True):
        axis = layout.mesh_axis(logical)
        if axis is not None and mesh_axis is None and layout.mesh.shape[axis] > 1:
            whole.append(f"{logical} ({size}) on {axis}={layout.mesh.shape[axis]}")
    return whole


def pool_paging(batch_size: int, max_length: int, window: int | None, mesh: Mesh, page_size: int = 16) -> Paging:
    """Paged pools with the capacity of a static cache of ``batch_size`` rows of ``max_length``
    tokens: the full-attention pool holds every row's tokens, a sliding pool (``window``: the
    model's sliding layers' window, None without them) every row's window at any offset (one
    page more than the window spans); each has the null page and is rounded up to a multiple of
    the devices the ``pages`` axis is split over (that split must divide)."""
    pages_axis = Layout.create(mesh).mesh_axis(PAGES)
    shards = 1 if pages_axis is None else mesh.shape[pages_axis]

    def pool(pages_per_row: int) -> int:
        return -(-(batch_size * pages_per_row + 1) // shards) * shards

    return Paging(
        page_size=page_size, num_pages=pool(-(-max_length // page_size)), max_length=max_length,
        sliding_num_pages=None if window is None else pool(-(-window // page_size) + 1),
    )  # fmt: skip


def parse_meshes(text: str) -> list[dict[str, int]]:
    """``"1x8,2x4"`` -> ``[{"data": 1, "model": 8}, {"data": 2, "model": 4}]``."""
    meshes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        data, sep, model = part.partition("x")
        if not sep or not data.isdigit() or not model.isdigit() or int(data) <= 0 or int(model) <= 0:
            raise ValueError(
                f"--meshes {text!r}: expected comma-separated DATAxMODEL sizes (e.g. 1x8,2x4), got {part!r}"
            )
        meshes.append({DATA: int(data), MODEL: int(model)})
    if not meshes:
        raise ValueError(f"--meshes {text!r}: give at least one DATAxMODEL mesh, e.g. 2x4")
    return meshes


def heads_cell(share: Share, mesh: Mesh) -> str:
    """How the K/V heads lie on the ``model`` axis, e.g. ``3, replicated on model=4``."""
    if share.kv_heads_split:
        return f"{share.kv_heads}, split over model={mesh.shape[MODEL]}"
    if mesh.shape[MODEL] == 1:
        return f"{share.kv_heads}, whole (model=1)"
    return f"{share.kv_heads}, replicated on model={mesh.shape[MODEL]}"


def model_rows(
    name: str, config: AttentionConfig, batch_size: int, max_length: int, meshes: Sequence[Mesh]
) -> tuple[list[str], list[str]]:
    """Table rows of one model (its static cache, then paged pools, on each mesh) and what
    stayed whole on a mesh axis (``Share.replicated``)."""
    window = config.sliding_window if "sliding_attention" in layer_types_of(config) else None
    rows, notes = [], []
    for kind in ("static", "paged"):
        for mesh in meshes:
            paging = pool_paging(batch_size, max_length, window, mesh) if kind == "paged" else None
            shares = [
                cache_share(config, batch_size, mesh, max_length=max_length, dtype=dtype, paging=paging)
                for dtype in DTYPES
            ]
            notes += [note for share in shares for note in share.replicated]
            sizes = " | ".join(f"{human_bytes(s.total)} | {human_bytes(s.per_device)}" for s in shares)
            split = shares[0].total / shares[0].per_device
            mesh_text = f"{mesh.shape[DATA]} x {mesh.shape[MODEL]}"
            rows.append(f"| {name} | {kind} | {mesh_text} | {heads_cell(shares[0], mesh)} | {sizes} | {split:.2f} |")
    return rows, notes


def sharding_table(
    configs: Mapping[str, AttentionConfig], batch_size: int, max_length: int, meshes: Sequence[Mesh]
) -> str:
    """Markdown: each model's cache on each mesh; below it, what the rules could not split."""
    names = [jnp.dtype(dtype).name for dtype in DTYPES]
    head = (
        "| model | cache | mesh (data x model) | K/V heads | "
        + " | ".join(f"{name} total | {name} per device" for name in names)
        + " | total / per device |"
    )
    lines, notes = [head, "|---|---|---|---|" + "---:|" * (2 * len(names) + 1)], []
    for name, config in configs.items():
        rows, model_notes = model_rows(name, config, batch_size, max_length, meshes)
        lines += rows
        notes += [f"{name}: {', '.join(dict.fromkeys(model_notes))}"] if model_notes else []
    whole = "; ".join(notes) or "nothing"
    return "\n".join(
        [*lines, "", f"Replicated because they do not divide the mesh axis (jaxkv.sharding warns): {whole}."]
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="rows of the cache (default 64)")
    parser.add_argument("--max-length", type=int, default=32768, help="tokens per row (default 32768)")
    parser.add_argument(
        "--meshes", type=parse_meshes, default="1x8,2x4,4x2,8x1", help="DATAxMODEL sizes, comma-separated"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # Before anything initializes JAX's backends: one CPU device per device of the largest mesh.
    jax.config.update("jax_num_cpu_devices", max(math.prod(shape.values()) for shape in args.meshes))
    devices = jax.devices("cpu")
    meshes = [make_mesh(shape, devices[: math.prod(shape.values())]) for shape in args.meshes]
    configs = {name: Pretrained(source).model().config for name, source in MODELS.items()}
    print(sharding_table(configs, args.batch, args.max_length, meshes))
    command = shlex.join(["python", "scripts/sharding_table.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"\nProduced by `{command}` (batch {args.batch}, {args.max_length} tokens per row).")


if __name__ == "__main__":
    main()
