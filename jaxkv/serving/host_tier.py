"""The host page tier: K/V pages kept in host memory under the device pools (vLLM's CPU offloading,
SGLang's HiCache host level).

Two kinds of page live here, each under a key the KV manager chooses:

* a *prefix page* (key ``(pool name, page hash)``) was evicted from the device prefix cache and
  demoted here instead of being dropped; a later prefix hit promotes it back (copied into a fresh
  device page, never recomputed). Prefix pages leave least recently demoted first when the tier
  needs room;
* a *swapped page* (key ``(pool name, owner, logical page)``) belongs to a sequence preempted by
  swap; it is pinned (never evicted) until its owner resumes (promoted) or is freed (discarded).

A page is moved in and out whole: ``demote(key, page)`` stores it, ``promote(key)`` takes it out
(``None``: not here). That pair is the interface a lower tier (disk) can offer too: an evicted
prefix page would go one tier down instead of being dropped, and a miss here would ask the tier
below.

Storage is plain numpy arrays, one ``HostPage`` per page holding one array per leaf of the pool's
paged groups (``[L, ...]``: K and V, or their codes and scales). Not a ``pinned_host`` JAX slab:
entries come and go one page at a time in LRU order (a slab would need its own slot allocator and
compiled scatters into host memory), a disk tier reads and writes numpy bytes directly, and on this
CPU backend both kinds are the same RAM. On a GPU a pinned slab would spare the staging copy of a
pageable transfer; the copies are batched per step either way (``jaxkv.serving.step``).

The arrays of a page demoted during scheduling arrive when the engine runs the step's copies
(device reads first, then writes), so a ``HostPage`` is created empty and filled before anybody
reads it.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

HostKey = Hashable


@dataclasses.dataclass(eq=False)
class HostPage:
    """One page in host memory: ``nbytes`` over every layer of its pool, and its arrays (one per
    leaf of the pool's paged groups, ``[L, ...]``), ``None`` until the step's copies fill them."""

    nbytes: int
    arrays: list[np.ndarray] | None = None


@dataclasses.dataclass
class TierCounters:
    """What moved through the tier since the engine started (pages and bytes each way)."""

    pages_in: int = 0  # demoted or swapped out: device -> host
    pages_out: int = 0  # promoted or swapped in: host -> device
    bytes_in: int = 0
    bytes_out: int = 0
    dropped: int = 0  # prefix pages evicted from the tier (or refused: no room) and lost


class HostTier:
    """Pages in host memory within ``capacity`` bytes (0: the tier is off and holds nothing)."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"host_kv_memory must not be negative, got {capacity} bytes")
        self.capacity = capacity
        self.used = 0
        self._pages: OrderedDict[HostKey, HostPage] = OrderedDict()  # front: least recently demoted
        self._pinned: set[HostKey] = set()
        self.pinned_bytes = 0
        self.counters = TierCounters()

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    def holds(self, key: HostKey) -> bool:
        return key in self._pages

    def get(self, key: HostKey) -> HostPage | None:
        """The page under ``key`` where it stays (no move, no recency change), or None."""
        return self._pages.get(key)

    def can_pin(self, nbytes: int) -> bool:
        """Could ``nbytes`` of pinned pages be stored now (evicting prefix pages as needed)?"""
        return self.pinned_bytes + nbytes <= self.capacity

    def demote(self, key: HostKey, page: HostPage, pinned: bool = False) -> bool:
        """Store ``page`` under ``key``, evicting the least recently demoted prefix pages until it fits.
        False, and nothing changed, when pinned pages leave no room. A ``pinned`` page is never evicted."""
        if key in self._pages:
            raise ValueError(f"host tier: {key!r} is already stored; a page lives in one place")
        if self.pinned_bytes + page.nbytes > self.capacity:
            if not pinned:
                self.counters.dropped += 1
            return False
        while self.used + page.nbytes > self.capacity:
            self._evict_oldest()
        self._pages[key] = page
        self.used += page.nbytes
        if pinned:
            self._pinned.add(key)
            self.pinned_bytes += page.nbytes
        self.counters.pages_in += 1
        self.counters.bytes_in += page.nbytes
        return True

    def promote(self, key: HostKey) -> HostPage | None:
        """Take the page out (it goes back to a device page); None when it is not here."""
        page = self._take(key)
        if page is not None:
            self.counters.pages_out += 1
            self.counters.bytes_out += page.nbytes
        return page

    def discard(self, key: HostKey) -> None:
        """Forget the page (its owner was freed, or the device holds its hash again); no-op if absent."""
        self._take(key)

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant. O(pages)."""
        total = sum(page.nbytes for page in self._pages.values())
        if total != self.used:
            raise AssertionError(f"host tier: used is {self.used} bytes, its pages hold {total}")
        if self.used > self.capacity:
            raise AssertionError(f"host tier: {self.used} bytes over its capacity of {self.capacity}")
        if not self._pinned <= self._pages.keys():
            raise AssertionError(f"host tier: pinned keys {self._pinned - self._pages.keys()} hold no page")
        pinned = sum(self._pages[key].nbytes for key in self._pinned)
        if pinned != self.pinned_bytes:
            raise AssertionError(f"host tier: pinned_bytes is {self.pinned_bytes}, its pinned pages hold {pinned}")

    def stored_keys(self) -> list[HostKey]:
        return list(self._pages)

    def pinned(self, key: HostKey) -> bool:
        return key in self._pinned

    def _take(self, key: HostKey) -> HostPage | None:
        page = self._pages.pop(key, None)
        if page is not None:
            self.used -= page.nbytes
            if key in self._pinned:
                self._pinned.remove(key)
                self.pinned_bytes -= page.nbytes
        return page

    def _evict_oldest(self) -> None:
        """Drop the least recently demoted prefix page (a lower tier would receive it here)."""
        key = next(key for key in self._pages if key not in self._pinned)
        self._take(key)
        self.counters.dropped += 1
