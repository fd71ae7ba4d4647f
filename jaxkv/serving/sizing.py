"""How many pages each pool gets from a byte budget (``kv_memory="1GiB"``).

Under a mesh the budget is the pools' total over all devices: the pages are split over the
mesh axis ``pages`` maps to (``data`` by default), so each pool's page count is a multiple of
that axis's size, and each device holds its share of the pages (of the K/V heads too, over
``model``)."""

from __future__ import annotations

import dataclasses
import re

import jax

from jaxkv.batch import PagedStorage
from jaxkv.cache import layer_types_of
from jaxkv.layers.paged import FULL_POOL, SLIDING_POOL, Paging
from jaxkv.protocol import has
from jaxkv.sharding import BATCH, PAGES, Layout

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
PAGED_LAYER_TYPES = (
    "full_attention", "sliding_attention", "linear_attention", "conv", "latent_attention", "indexed_attention",
)  # fmt: skip


def parse_bytes(value: int | str, name: str = "kv_memory") -> int:
    """``"1GiB"``, ``"512 MiB"``, ``"2GB"`` or an int -> bytes; ``name``: the option, for the error."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if match is None or match.group(2).upper() not in UNITS:
        raise ValueError(f"{name} {value!r} is not a size: write e.g. '1GiB', '512MiB' or a number of bytes")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """Pages per pool (the null page included; 0: the model has no such layer) and their bytes."""

    full_pages: int
    full_page_bytes: int
    sliding_pages: int
    sliding_page_bytes: int
    window: int | None
    page_size: int
    state_bytes: int = 0  # per-row slots (recurrent states, evicted K/V), outside the pools
    page_shards: int = 1  # devices a pool's pages are split over (each pool's page count is a multiple)

    @property
    def max_concurrent_tokens(self) -> int:
        """Tokens the full-attention pool holds at once (all requests together); a model without
        full-attention layers is bounded only by its rows."""
        return (self.full_pages - 1) * self.page_size if self.full_pages else 0


@dataclasses.dataclass(frozen=True)
class PageBytes:
    """What ``page_bytes_of`` reads from the model's paged cache: the bytes of one page of each
    pool ('full', 'sliding') over all its layers, the sliding window, the bytes of the
    per-row slots (recurrent states, evicted K/V), and the devices a pool's pages are split over."""

    pools: dict[str, int]
    window: int | None
    state_bytes: int
    page_shards: int


def shards_of(layout: Layout | None, logical: str) -> int:
    """Devices the ``logical`` axis (``pages``, ``batch``) is split over under ``layout`` (1: unsharded)."""
    axis = None if layout is None else layout.mesh_axis(logical)
    return 1 if axis is None else layout.mesh.shape[axis]


def page_bytes_of(model, config, max_model_len: int) -> PageBytes:
    """``PageBytes`` read from the shapes of the model's paged cache (nothing allocated). The
    probe's pools hold a page count every mesh axis divides (one page per device, at least 2),
    and one row per device; per-row slots (recurrent states, evicted K/V) are split over the mesh
    axis ``batch`` maps to, so under a mesh ``max_num_seqs`` must be a multiple of it."""
    layer_types = layer_types_of(model.config)
    unsupported = sorted(set(layer_types) - set(PAGED_LAYER_TYPES))
    if unsupported:
        raise ValueError(
            f"the serving engine serves {', '.join(PAGED_LAYER_TYPES)} layers; this model has {unsupported}"
        )
    devices = jax.device_count()
    paging = Paging(
        config.page_size, max(2, devices), max_model_len, scored=config.scores_slots,
        compacted=config.max_pages_per_request is not None, retrieval=config.retrieval,
    )  # fmt: skip
    probe = jax.eval_shape(
        lambda: model.init_cache(
            devices,
            paging=paging,
            quantization=config.quantization,
            eviction=config.eviction,
            rollback_slots=config.decode_width - 1,
        )  # fmt: skip
    )  # rollback slots: a speculating engine's recurrent states keep the last k states of a row
    sizes, window, row_bytes = {FULL_POOL: 0, SLIDING_POOL: 0}, None, 0
    for group in probe.groups:
        if not has(group, PagedStorage):  # per-row slots: recurrent states, evicted K/V
            row_bytes += sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(group)) // devices
            continue
        window = group.window if group.pool == SLIDING_POOL else window
        for leaf in jax.tree.leaves(group):  # its pages: values, or codes and scales
            sizes[group.pool] += leaf.size // leaf.shape[1] * leaf.dtype.itemsize  # one page over the stack
    row_shards = shards_of(probe.layout, BATCH)
    if row_bytes and config.max_num_seqs % row_shards:
        raise ValueError(
            f"max_num_seqs ({config.max_num_seqs}) must be a multiple of the {row_shards} devices of the mesh axis "
            f"{probe.layout.mesh_axis(BATCH)!r}: this model's per-row slots (recurrent states, evicted K/V) are "
            "split over it"
        )
    return PageBytes(sizes, window, row_bytes * config.max_num_seqs, shards_of(probe.layout, PAGES))


def pool_sizes(model, config, max_model_len: int) -> PoolSizes:
    """Split ``config.kv_memory`` between the pools: the sliding pool gets what its rows can
    read at once (window plus a step's chunk, per row), the full pool the rest. Under a mesh
    each count is a multiple of the devices the pages are split over (the sliding pool rounded
    up, the full pool down)."""
    probe = page_bytes_of(model, config, max_model_len)
    page_bytes, shards = probe.pools, probe.page_shards
    budget = parse_bytes(config.kv_memory) - probe.state_bytes
    sliding_pages = 0
    if probe.window is not None:
        per_row = -(-(probe.window - 1) // config.page_size) + 2
        needed = config.max_num_seqs * per_row + -(-config.max_num_batched_tokens // config.page_size) + 1
        sliding_pages = -(-needed // shards) * shards
        budget -= sliding_pages * page_bytes[SLIDING_POOL]
    full_pages = budget // page_bytes[FULL_POOL] // shards * shards if page_bytes[FULL_POOL] else 0
    if budget < 0 or (page_bytes[FULL_POOL] and full_pages < 2):
        raise ValueError(
            f"kv_memory {config.kv_memory!r} cannot hold the pools: the sliding-window pool needs {sliding_pages} "
            f"pages of {page_bytes[SLIDING_POOL]} bytes, the per-row slots (recurrent states, evicted K/V) "
            f"{probe.state_bytes} bytes, and the "
            f"full-attention pool at least {max(2, shards)} pages of {page_bytes[FULL_POOL]} bytes (a multiple of the "
            f"{shards} devices its pages are split over); raise kv_memory or lower max_num_seqs"
        )
    return PoolSizes(
        full_pages, page_bytes[FULL_POOL], sliding_pages, page_bytes[SLIDING_POOL], probe.window, config.page_size,
        probe.state_bytes, shards,
    )  # fmt: skip
