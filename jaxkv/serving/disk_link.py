"""The disk tier in the host tier's terms: one ``DiskPageStore`` per page pool, keyed as the host tier
keys a prefix page (``kv_manager.prefix_key``: ``(pool name, page hash)``), holding a ``HostPage``.

    disk = DiskTier(directory, identity=model_identity(model), max_bytes=8 << 30,
                    formats=pool_formats(page_formats(cache), page_size=16, quantization=None))
    disk.save(("full", page_hash), host_page)     # a prefix page whose arrays the step's copies filled
    disk.load(("full", page_hash))                # a HostPage with its arrays, or None

A pool's ``page_format`` lists the shape and dtype of each of its leaves in the order of a
``HostPage``'s arrays (``step.page_formats``: per paged group, each leaf ``[L, page_size, H_kv, ·]``,
K and V or their codes and scales), the page size and the quantization spec (int8 and fp8 codes
are both uint8 of one shape), so a page is only read back into a pool laid out as the one that
wrote it. Each pool's store has its own namespace and its own ``max_bytes``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from jaxkv.kernels import TOKENS_LAYOUT
from jaxkv.quantization import QuantSpec
from jaxkv.serving.disk_tier import DiskPageStore
from jaxkv.serving.host_tier import HostKey, HostPage

LAYOUT = "jaxkv.serving.step.page_formats: per paged group, each leaf [L, page_size, H_kv, D or packed D]"


def pool_formats(
    page_formats: Sequence[tuple[str, Sequence[jax.ShapeDtypeStruct]]],
    *,
    page_size: int,
    quantization: QuantSpec | None,
    layout: str = TOKENS_LAYOUT,
) -> dict[str, dict]:
    """Each pool's ``page_format`` from ``step.page_formats(cache)`` (its groups' leaves, in order;
    ``layout``: the pools' ``Paging.layout``, whose pages' leaves are ``[L, H_kv, page_size, ·]``
    when 'heads')."""
    formats: dict[str, dict] = {}
    for pool, leaves in page_formats:
        entry = formats.setdefault(
            pool,
            {
                "pool": pool,
                "page_size": page_size,
                "quantization": None if quantization is None else dataclasses.asdict(quantization),
                "layout": LAYOUT if layout == TOKENS_LAYOUT else f"{LAYOUT}; pool layout {layout}",
                "leaves": [],
            },
        )
        entry["leaves"] += [[list(leaf.shape), np.dtype(leaf.dtype).name] for leaf in leaves]
    return formats


class DiskTier:
    """Prefix pages of every pool on disk under ``directory`` (one ``DiskPageStore`` per pool of
    ``formats``, each limited to ``max_bytes``)."""

    def __init__(self, directory: str | os.PathLike, *, identity: Mapping, formats: Mapping[str, dict], max_bytes: int):
        self.formats = dict(formats)
        self.stores = {
            pool: DiskPageStore(directory, identity=identity, page_format=page_format, max_bytes=max_bytes)
            for pool, page_format in formats.items()
        }

    def save(self, key: HostKey, page: HostPage) -> bool:
        """Store the prefix page ``key`` = ``(pool, page hash)``; True if a file was written. Its arrays
        must be the pool's leaves (``pool_formats``)."""
        if page.arrays is None:
            raise ValueError(f"disk tier: page {key!r} has no arrays yet (save it after the step's copies)")
        pool, page_hash = key
        store, page_format = self._pool(pool)
        leaves = [[list(array.shape), array.dtype.name] for array in page.arrays]
        if leaves != page_format["leaves"]:
            raise ValueError(f"disk tier: page {key!r} holds {leaves}, the {pool} pool's pages {page_format['leaves']}")
        return store.put(page_hash, {f"{i:03d}": array for i, array in enumerate(page.arrays)})

    def load(self, key: HostKey) -> HostPage | None:
        """The prefix page ``key`` read back (its arrays in ``HostPage`` order), or None."""
        pool, page_hash = key
        store, _ = self._pool(pool)
        found = store.get(page_hash)
        if found is None:
            return None
        arrays = [found[name] for name in sorted(found)]
        return HostPage(sum(array.nbytes for array in arrays), arrays)

    def holds(self, key: HostKey) -> bool:
        pool, page_hash = key
        store, _ = self._pool(pool)
        return store.contains(page_hash)

    @property
    def capacity(self) -> int:
        """The most bytes the tier holds: each pool's ``max_bytes``."""
        return sum(store.max_bytes for store in self.stores.values())

    def stats(self) -> dict[str, dict]:
        """Each pool's store counters (``DiskPageStore.stats``) with its pages and bytes on disk."""
        return {
            pool: store.stats() | {"pages": len(store), "bytes": store.nbytes} for pool, store in self.stores.items()
        }

    def _pool(self, pool: str) -> tuple[DiskPageStore, dict]:
        """The store and the ``page_format`` of ``pool``."""
        if pool not in self.stores:
            raise ValueError(f"disk tier: no pool {pool!r} (pools: {sorted(self.stores)})")
        return self.stores[pool], self.formats[pool]
