"""The tiers below the device pools, for the KV manager: the host tier (``host_tier``), the disk
tier (``disk_link``), the sequences swapped out to host memory, and the copies between those
tiers and the device pools that the next step makes (``PageMoves``). The KV manager owns the
device pools' ledgers and the prefix cache; it tells the ``TierManager`` which device pages leave
or come back, and the tier manager keeps the pages and queues the copies. No page is copied while
the scheduler runs: the bytes move once per step, before it runs (``KVCacheManager.take_moves``:
all reads from the device first, then all writes to it).

With a host tier (``host_kv_memory``) pages leave the device pools without being lost: a cached
page that an allocation evicts is demoted to host memory (``demote``), and a prefix hit may find
pages there, promoted into fresh device pages (``take``, then ``write``; registered under their
hash again: a page lives in one tier at a time). A preempted sequence may be swapped out: its
pages that the prefix cache does not hold go to the host tier, pinned, and come back when it
resumes.

With a disk tier (``kv_cache_dir``) every page the prefix cache registers is also written to disk
once (``registered``: read from the device with the step's other reads, saved by ``save`` after
them), so a restarted engine finds its prefixes there: a prefix hit may find pages on disk, read
back into fresh device pages like host pages. A page already on disk is not written again; a page
gone from disk between the lookup and the admission (another engine's size limit, a file refused
as corrupt) makes the admission wait for the next lookup.

Swap or recompute (``swap_pays``): preempting by recompute costs the tokens the prefix cache will
not serve again, ``num_computed - num_registered * page_size`` (the registered pages stay cached in
either case); swapping costs a round trip of the pages holding them to host memory. Swap when
``tokens >= PAGE_COPY_TOKENS * pages``: a page's round trip is priced like recomputing
``PAGE_COPY_TOKENS`` tokens. So a sequence whose unregistered tail is one page holding a token or two
is recomputed, a long tail (no prefix caching: every page) is swapped.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Hashable, Iterable

from jaxkv.layers.paged import NULL_PAGE
from jaxkv.serving.compaction import Compaction
from jaxkv.serving.disk_link import DiskTier
from jaxkv.serving.host_tier import HostKey, HostPage, HostTier
from jaxkv.serving.requests import SequenceState
from jaxkv.serving.stats import TierStats

# Recomputed tokens a page's round trip to host memory is priced at (see the module docstring). A page
# of a 1B-parameter float32 model with 16 tokens holds ~1 MiB: 2 x 1 MiB over PCIe (~25 GB/s) is ~80 us,
# recomputing one token ~2 GFLOP, ~20-40 us on a GPU: about two tokens. On a CPU the copy is a memcpy.
PAGE_COPY_TOKENS = 2
# The disk tier's counters summed over its pools into its ``TierStats`` (``DiskPageStore.stats`` and its size).
DISK_STAT_KEYS = ("pages", "bytes", "pages_written", "bytes_written", "pages_read", "bytes_read")


@dataclasses.dataclass(frozen=True)
class HostSource:
    """A page of a hit that lives in the host tier: its ``key`` there, and the hash it is cached under
    once back in a device page (None: a swapped page, which the prefix cache does not hold)."""

    key: HostKey
    page_hash: bytes | None


PageSource = int | HostSource  # a device page, or a page in the host tier


def prefix_key(pool: str, page_hash: bytes) -> HostKey:
    """The host tier's key of a prefix page: its pool and hash (the hash chain includes the salt)."""
    return (pool, page_hash)


def swap_key(pool: str, owner: Hashable, logical: int) -> HostKey:
    """The host tier's key of a swapped page: its pool, owner and logical page."""
    return (pool, owner, logical)


@dataclasses.dataclass(frozen=True)
class Swapped:
    """A sequence preempted by swap: ``num_tokens`` computed tokens, its first ``num_registered``
    pages in the prefix cache (any tier), the rest per pool name from page ``num_registered`` on in
    the host tier (``NULL_PAGE`` where a window had dropped them)."""

    num_tokens: int
    num_registered: int
    pages: dict[str, list[PageSource]]


@dataclasses.dataclass
class PageMoves:
    """The copies between the device pools and the host tier that the next step makes before it
    runs, per pool name: ``out`` ``(device page, host page)`` reads, all made first (a page read may
    be written again this step), then ``into`` ``(host page, device page)`` writes; ``persist``:
    ``(key, host page)`` of pages read for the disk tier, saved once the reads are made."""

    out: dict[str, list[tuple[int, HostPage]]] = dataclasses.field(default_factory=dict)
    into: dict[str, list[tuple[HostPage, int]]] = dataclasses.field(default_factory=dict)
    persist: list[tuple[HostKey, HostPage]] = dataclasses.field(default_factory=list)
    compactions: list[Compaction] = dataclasses.field(default_factory=list)  # made between the reads and the writes

    def __bool__(self) -> bool:
        return any(self.out.values()) or any(self.into.values()) or bool(self.compactions)


@dataclasses.dataclass(frozen=True)
class Tail:
    """A sequence's pages in one pool that a swap copies out: ``pages`` (``NULL_PAGE`` where a window
    left one) from logical page ``start`` on, each of ``page_bytes``."""

    pages: list[int]
    start: int
    page_bytes: int

    @property
    def held(self) -> int:
        """Pages of the tail that hold K/V (not ``NULL_PAGE``)."""
        return sum(page != NULL_PAGE for page in self.pages)


class TierManager:
    """The host tier of ``host_bytes`` (0: none) and the disk tier ``disk`` (None: none) under one
    engine's device pools, its swapped-out sequences and the copies queued for the next step.
    ``preemption``: 'auto' (swap when ``swap_pays``), 'swap' (whenever the host tier has room) or
    'recompute' (never swap)."""

    def __init__(self, host_bytes: int, preemption: str, disk: DiskTier | None):
        self.host = HostTier(host_bytes)
        self.disk = disk
        self.preemption = preemption
        self.swapped: dict[Hashable, Swapped] = {}
        self._moves = PageMoves()

    @property
    def on(self) -> bool:
        """Is there a tier below the device (pages are copied between it and the device pools)?"""
        return bool(self.host.capacity) or self.disk is not None

    def below(self, key: HostKey) -> bool:
        """Does a tier below the device hold the prefix page ``key`` (the host tier, else the disk)?"""
        return self.host.holds(key) or (self.disk is not None and self.disk.holds(key))

    def demote(self, pool: str, page_bytes: int, evictions: Iterable[tuple[int, bytes]]) -> None:
        """The cached pages ``(device page, hash)`` that an allocation in ``pool`` evicts go to the host
        tier, read before the next step (dropped when the tier is off or full of pinned pages)."""
        for page, page_hash in evictions:
            host_page = HostPage(page_bytes)
            if self.host.demote(prefix_key(pool, page_hash), host_page):
                self._moves.out.setdefault(pool, []).append((page, host_page))

    def registered(self, pool: str, page_bytes: int, page: int, key: HostKey) -> None:
        """The prefix cache registered ``page`` of ``pool`` under ``key``: a host copy of it is
        dropped (a page lives in one tier), and it is read for the disk tier unless it is there."""
        self.host.discard(key)
        if self.disk is None or self.disk.holds(key):
            return
        host_page = HostPage(page_bytes)
        self._moves.out.setdefault(pool, []).append((page, host_page))
        self._moves.persist.append((key, host_page))

    def take(self, keys: dict[str, list[HostKey]]) -> tuple[dict[str, list[HostPage]], int] | None:
        """The pages ``keys`` (per pool name) out of the tiers below, and how many of them came from
        disk: the pages the host tier lacks are read from disk first, so that one gone from disk
        since the lookup changes nothing (None)."""
        wanted = [key for found in keys.values() for key in found if not self.host.holds(key)]
        loaded = {key: self.disk.load(key) for key in wanted}
        if None in loaded.values():
            return None
        taken = {name: [loaded.get(key) or self.host.promote(key) for key in found] for name, found in keys.items()}
        return taken, len(loaded)

    def write(self, pool: str, host_page: HostPage, page: int) -> None:
        """Queue the write of ``host_page`` into the device page ``page`` of ``pool``."""
        self._moves.into.setdefault(pool, []).append((host_page, page))

    def may_swap(self, seq: SequenceState) -> bool:
        """Could a running ``seq`` be swapped out at all (a swapping mode, tokens, a host tier)?"""
        return self.preemption != "recompute" and seq.num_computed > 0 and self.host.capacity > 0

    def swap_out(self, seq: SequenceState, tails: dict[str, Tail], tokens: int) -> bool:
        """Swap out ``seq`` if that pays (``swap_pays`` for its ``tokens`` the prefix cache does not
        hold, unless ``preemption`` says) and the host tier has room: a pinned host copy of each
        page of its ``tails`` (per pool name), read before the next step. False, and nothing
        changed, when it is to be recomputed instead; the KV manager frees its device pages."""
        num_pages = sum(tail.held for tail in tails.values())
        nbytes = sum(tail.held * tail.page_bytes for tail in tails.values())
        pays = self.preemption == "swap" or self.swap_pays(tokens, num_pages)
        if not pays or not self.host.can_pin(nbytes):
            return False
        pages = {pool: self._swap_pages(pool, seq.key, tail) for pool, tail in tails.items()}
        self.swapped[seq.key] = Swapped(seq.num_computed, seq.num_registered, pages)
        return True

    @staticmethod
    def swap_pays(tokens: int, pages: int) -> bool:
        """The cost rule: swapping ``pages`` (out and back) beats recomputing ``tokens``."""
        return tokens >= PAGE_COPY_TOKENS * pages

    def forget_swap(self, key: Hashable) -> None:
        """Drop the swapped-out pages of the sequence ``key`` (it resumed from them, or they are of no use)."""
        swapped = self.swapped.pop(key, None)
        for sources in () if swapped is None else swapped.pages.values():
            for page in sources:
                if isinstance(page, HostSource):
                    self.host.discard(page.key)

    def take_moves(self, compactions: list[Compaction]) -> PageMoves:
        """The copies queued since the last call, with the step's ``compactions``."""
        moves, self._moves = self._moves, PageMoves()
        moves.compactions = compactions
        return moves

    def save(self, pages: list[tuple[HostKey, HostPage]]) -> None:
        """Write the prefix pages read for the disk tier (``PageMoves.persist``, once the step's copies
        filled them); a failing disk costs a warning, never a request."""
        for key, page in pages:
            try:
                self.disk.save(key, page)
            except OSError as error:
                warnings.warn(f"disk tier: a page could not be saved ({type(error).__name__}: {error})", stacklevel=4)

    def host_stats(self, hit_pages: int) -> TierStats:
        """The host tier's ``TierStats`` (``hit_pages``: the prefix cache's, counted by the KV manager)."""
        host, counters = self.host, self.host.counters
        return TierStats(
            pages=host.num_pages, bytes=host.used, capacity_bytes=host.capacity, hit_pages=hit_pages,
            pages_written=counters.pages_in, bytes_written=counters.bytes_in, pages_read=counters.pages_out,
            bytes_read=counters.bytes_out, dropped_pages=counters.dropped, pinned_bytes=host.pinned_bytes,
        )  # fmt: skip

    def disk_stats(self, hit_pages: int) -> TierStats:
        """The disk tier's ``TierStats`` over its pools (zeros without one)."""
        pools = {} if self.disk is None else self.disk.stats()
        totals = {key: sum(pool[key] for pool in pools.values()) for key in DISK_STAT_KEYS}
        return TierStats(
            **totals, capacity_bytes=0 if self.disk is None else self.disk.capacity, hit_pages=hit_pages,
            dropped_pages=sum(pool["pages_evicted"] for pool in pools.values()),
            refused_files=sum(sum(pool["rejected"].values()) for pool in pools.values()),
        )  # fmt: skip

    def check(self, on_device: Callable[[HostKey], bool]) -> None:
        """Raise ``AssertionError`` naming the first broken invariant: the host tier's, no prefix
        page both here and on the device (``on_device(key)``), pinned host pages exactly the
        swapped sequences' pages. O(host tier)."""
        self.host.check()
        swapped = {page.key for s in self.swapped.values() for p in s.pages.values() for page in p if page != NULL_PAGE}
        for key in self.host.stored_keys():
            if key in swapped:
                continue
            if on_device(key):
                pool, page_hash = key
                raise AssertionError(f"page hash {page_hash.hex()} of the {pool} pool is in both tiers")
            if self.host.pinned(key):
                raise AssertionError(f"prefix page {key!r} is pinned in the host tier")
        missing = [key for key in swapped if not self.host.pinned(key)]
        if missing:
            raise AssertionError(f"swapped pages {missing} are not pinned in the host tier")

    def _swap_pages(self, pool: str, owner: Hashable, tail: Tail) -> list[PageSource]:
        """Pin a host copy of each page of ``tail`` (``NULL_PAGE`` stays) and queue its read."""
        sources: list[PageSource] = []
        for logical, page in enumerate(tail.pages, start=tail.start):
            if page == NULL_PAGE:
                sources.append(NULL_PAGE)
                continue
            key, host_page = swap_key(pool, owner, logical), HostPage(tail.page_bytes)
            self.host.demote(key, host_page, pinned=True)
            self._moves.out.setdefault(pool, []).append((page, host_page))
            sources.append(HostSource(key, None))
        return sources
