"""The engine's statistics, typed (``Engine.stats()``): an ``EngineStats`` snapshot over the
scheduler, the model runner and the KV manager, whose own are a ``PoolStats`` per page pool, its
``PrefixCacheStats`` and a ``TierStats`` per memory tier (the device pools, host memory, disk).

Counters run since the engine started; the rest is what holds when the snapshot is taken. Each
field is documented where it is declared. ``/metrics`` (``jaxkv.server.api.Metrics``), the
serving benchmark and the tests read them by attribute::

    stats = engine.stats()
    stats.num_waiting, stats.prefix_cache.hit_rate, stats.disk.pages_read, stats.speculation.accepted

``EngineStats.as_dict`` is the plain nested dict ``Engine.stats()`` returned before these types
(the serving benchmark's JSON rows keep it). Deprecated: ``stats()["key"]`` still reads that dict's
top-level keys, with a ``DeprecationWarning``, for one release.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxkv.serving.speculation import SpeculationStats


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """One page pool's pages now (the null page aside)."""

    used: int  # pages held by a sequence
    free: int  # pages no sequence holds (cached ones included): what an allocation may take
    cached: int  # pages holding a prefix the cache finds by hash, held or free
    usable: int  # every page of the pool
    page_bytes: int  # bytes one page holds over every layer of the pool (K and V)


@dataclasses.dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache since start, over every pool and tier (``prefix_caching``; zeros when off)."""

    queried_tokens: int  # tokens of the sequences admitted (a swapped-out sequence resuming is not a query)
    hit_tokens: int  # of those, found in the cache (pages in any tier) and not computed again

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclasses.dataclass(frozen=True)
class TierStats:
    """One memory tier of the K/V pages: the device pools, the host tier (``host_kv_memory``) or the
    disk tier (``kv_cache_dir``); a tier that is off reads zeros. Pages move between tiers only
    below the device, so the device's counters of moved pages are zeros."""

    pages: int  # pages held now (the device: in use by a sequence; the disk: every engine's files on its directory)
    bytes: int  # bytes those pages hold (the disk: file bytes)
    capacity_bytes: int  # the most bytes the tier holds (the device: every usable page; 0: the tier is off)
    hit_pages: int  # prefix-cache pages found in this tier since start
    pages_written: int = 0  # pages copied into the tier since start (host: demoted or swapped out; disk: files)
    bytes_written: int = 0  # their bytes
    pages_read: int = 0  # pages copied out of the tier since start (host: promoted or swapped in; disk: files)
    bytes_read: int = 0  # their bytes
    dropped_pages: int = 0  # prefix pages evicted to make room, or refused for want of it, and lost since start
    pinned_bytes: int = 0  # the host tier: bytes of swapped-out sequences' pages, never evicted
    refused_files: int = 0  # the disk tier: page files refused since start (corrupt, another model's, ...)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """One engine's statistics (the module docstring)."""

    num_running: int  # sequences holding a row
    num_waiting: int  # sequences waiting for a row or pages
    num_steps: int  # compiled steps run since start
    num_compiled: int  # step executables compiled since start
    preemptions: int  # running sequences preempted since start
    swaps: int  # of those, whose pages went to the host tier
    recomputes: int  # of those, whose pages were freed, to be computed again
    compactions: int  # compactions planned since start (``max_pages_per_request``)
    prefix_cache: PrefixCacheStats  # the prefix cache's queries and hits
    page_size: int  # tokens a page holds
    pages: dict[str, PoolStats]  # per pool name ('full', 'sliding'): its pages now
    peak_pages_used: int  # most pages in use at once over every pool, since start
    peak_kv_bytes: int  # their bytes at that peak
    wasted_slot_fraction: float  # of the running rows' allocated slots over every step, those holding no token
    max_concurrent_tokens: int  # tokens the pools hold at once (``PoolSizes.max_concurrent_tokens``)
    device: TierStats  # the device pools
    host: TierStats  # the host tier
    disk: TierStats  # the disk tier
    speculation: SpeculationStats  # draft tokens proposed and accepted (zeros without speculative decoding)

    @property
    def page_bytes(self) -> int:
        """Bytes one page holds over every pool (a page of each)."""
        return sum(pool.page_bytes for pool in self.pages.values())

    def as_dict(self) -> dict:
        """The plain nested dict ``Engine.stats()`` returned before these types, its keys unchanged
        (the serving benchmark's JSON rows; the deprecated item access)."""
        host, disk = self.host, self.disk
        return {
            "num_running": self.num_running, "num_waiting": self.num_waiting, "num_steps": self.num_steps,
            "num_compiled": self.num_compiled, "preemptions": self.preemptions, "swaps": self.swaps,
            "recomputes": self.recomputes, "compactions": self.compactions,
            "prefix_hit_rate": self.prefix_cache.hit_rate, "page_size": self.page_size, "page_bytes": self.page_bytes,
            "pages": {name: _pool_usage(pool) for name, pool in self.pages.items()},
            "peak_pages_used": self.peak_pages_used, "peak_kv_bytes": self.peak_kv_bytes,
            "wasted_slot_fraction": self.wasted_slot_fraction, "max_concurrent_tokens": self.max_concurrent_tokens,
            "tiers": {
                "device": {"pages": self.device.pages, "cached_pages": sum(p.cached for p in self.pages.values()),
                           "hit_pages": self.device.hit_pages},
                "host": {"pages": host.pages, "bytes": host.bytes, "pinned_bytes": host.pinned_bytes,
                         "capacity_bytes": host.capacity_bytes, "hit_pages": host.hit_pages,
                         "pages_in": host.pages_written, "pages_out": host.pages_read, "bytes_in": host.bytes_written,
                         "bytes_out": host.bytes_read, "dropped_pages": host.dropped_pages},
                "disk": {"hit_pages": disk.hit_pages, "pages": disk.pages, "bytes": disk.bytes,
                         "pages_written": disk.pages_written, "bytes_written": disk.bytes_written,
                         "pages_read": disk.pages_read, "bytes_read": disk.bytes_read,
                         "refused_files": disk.refused_files},
            },
            "speculation": self.speculation.as_dict(),
        }  # fmt: skip

    def __getitem__(self, key: str):
        """Deprecated: ``stats()["key"]`` reads ``as_dict()[key]``; read the attributes instead."""
        warnings.warn(
            f"Engine.stats()[{key!r}] is deprecated and will be removed in the next release: Engine.stats() "
            "returns an EngineStats, read its attributes (jaxkv.serving.stats)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.as_dict()[key]


def _pool_usage(pool: PoolStats) -> dict[str, int]:
    """A pool's pages as ``PageManager.usage`` gives them (the old ``stats()['pages']`` entry)."""
    return {"used": pool.used, "free": pool.free, "cached": pool.cached, "usable": pool.usable}
