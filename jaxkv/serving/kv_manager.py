"""KV-cache management: the page pools' ledgers, the prefix cache and the allocations, behind the
few questions the scheduler asks (vLLM's ``KVCacheManager``).

Each pool (the full-attention layers; the sliding-window layers) has its own ``PageManager``
and block table. The scheduler never touches a page: it asks for room for a sequence's next
tokens (``allocate``, with the prefix the cache holds for a new sequence from ``lookup``), for a
fork of a computed prompt (``fork``), to swap out a preempted sequence (``swap_out``), and hands
back what finished (``free``); each answer is one ``Allocation``, or None when there is no room
(and then nothing changed).

The KV manager keeps the ledgers, the prefix cache and the allocations, and composes two parts
it asks (no page is theirs): the tiers below the device (``jaxkv.serving.tier_manager``: the host
and disk tiers, swapped-out sequences, the copies the next step makes) and the page budgets
(``jaxkv.serving.compaction.CompactionPlanner``). A page lives in one tier at a time: a cached
page an allocation evicts is demoted to the host tier, a prefix hit may find pages in a tier
below, promoted into fresh device pages (registered under their hash again), and every page the
prefix cache registers is also written to disk once. A preempted sequence is swapped out when
that pays (``TierManager.swap_pays``): its pages the prefix cache does not hold go to the host
tier, pinned, and come back when it resumes. The KV manager decides every move while the
scheduler runs; the bytes move once per step, before it runs (``take_moves``).

With a page budget (``max_pages_per_request``, ``jaxkv.serving.compaction``) a sequence whose
next tokens would need one page more than its budget in the full-attention pool is compacted
first (``allocate`` plans it, the step's moves make it, between the reads and the writes).
``room`` caps a chunk so that it fits, and says 0 when the step's compactions are used up (the
sequence waits a step). Compactions happen only to running sequences, so an admitted sequence is
below its budget: a prefix hit is used up to ``max_pages - 1`` pages, and a sequence swapped out
at its budget takes its pages back with no tokens, then compacts as a running sequence in the
next step (one compacted in this step is preempted by recompute: a swap would copy its pages out
before the compaction). A row's compactions then happen at the same lengths however it is
batched, preempted or resumed. A compacted
sequence's pages are never registered in the prefix cache (their contents are no longer their
hash's tokens), and it is never forked (its children are computed like new requests). The
scheduler admits a sequence only while the pool holds every running sequence's budget and its
own (``holds_budgets``), so rows do not outgrow the pool.

Statistics: ``pool_stats``, ``prefix_stats`` and ``tier_stats`` (``jaxkv.serving.stats``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from jaxkv.layers.paged import FULL_POOL, NULL_PAGE, pool_name, table_width
from jaxkv.serving.compaction import CompactionPlanner, PageBudget
from jaxkv.serving.disk_link import DiskTier
from jaxkv.serving.host_tier import HostKey, HostPage
from jaxkv.serving.pages import Owner, PageManager, page_hashes, salt_key
from jaxkv.serving.requests import RequestError, SequenceState
from jaxkv.serving.sizing import PoolSizes
from jaxkv.serving.stats import PoolStats, PrefixCacheStats, TierStats
from jaxkv.serving.tier_manager import HostSource, PageMoves, PageSource, Swapped, Tail, TierManager, prefix_key

PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclasses.dataclass
class PagePool:
    """The host ledger of the pages of the layers that share one block table: all full-attention
    layers (``window`` None), or all sliding-window layers."""

    manager: PageManager
    window: int | None
    page_bytes: int  # bytes one page holds over every layer of the pool (K and V)

    @property
    def name(self) -> str:
        return pool_name(self.window)

    @property
    def page_size(self) -> int:
        return self.manager.page_size

    def first_needed_page(self, position: int) -> int:
        """The first logical page a query at ``position`` reads."""
        return 0 if self.window is None else max(0, position - self.window + 1) // self.page_size

    def pages_needed(self, seq: SequenceState, end: int) -> int:
        """Pages to allocate so that ``seq`` holds its tokens up to ``end``."""
        return max(-(-end // self.page_size) - len(self.manager.pages(seq.key)), 0)

    def cached_pages(
        self, hashes: Sequence[bytes], first: int, end: int, below: Callable[[HostKey], bool]
    ) -> list[PageSource] | None:
        """Where the cached pages ``first .. end - 1`` of the chain ``hashes`` are: a device page, or
        a tier below the device (``below(key)``: the host tier or the disk holds it); None if some
        page is in none."""
        found: list[PageSource] = []
        for page_hash in hashes[first:end]:
            source = self._source(page_hash, below)
            if source is None:
                return None
            found.append(source)
        return found

    def held_pages(self, hashes: Sequence[bytes], below: Callable[[HostKey], bool]) -> list[PageSource | None]:
        """Where each page of the chain ``hashes`` is (``cached_pages``' sources), None where it is in
        no tier. Pages past a full-attention pool's first miss are None unasked (no prefix reaches
        them); a sliding pool asks for every page (a longer prefix needs only its window's)."""
        found: list[PageSource | None] = []
        for page_hash in hashes:
            found.append(self._source(page_hash, below))
            if found[-1] is None and self.window is None:
                return found + [None] * (len(hashes) - len(found))
        return found

    def _source(self, page_hash: bytes, below: Callable[[HostKey], bool]) -> PageSource | None:
        """The device page cached under ``page_hash``, else a ``HostSource`` if a tier below holds it."""
        page = self.manager.cached(page_hash)
        if page is not None:
            return page
        key = prefix_key(self.name, page_hash)
        return HostSource(key, page_hash) if below(key) else None


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The longest prefix of a sequence the cache holds in every pool: ``pages`` per pool name
    (empty: none; ``NULL_PAGE`` where a window no longer reads), ``num_tokens`` tokens of it.
    ``resumes``: the hit is a swapped-out sequence's pages (``swap_out``)."""

    pages: dict[str, list[PageSource]]
    num_tokens: int
    resumes: bool = False

    def below(self, pool: PagePool) -> list[tuple[int, HostSource]]:
        """``(logical page, source)`` of the hit's pages in a tier below the device that ``pool`` still reads."""
        first = pool.first_needed_page(self.num_tokens)
        sources = self.pages.get(pool.name, [])
        return [
            (logical, page) for logical, page in enumerate(sources) if isinstance(page, HostSource) and logical >= first
        ]


NO_HIT = PrefixHit({}, 0)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The KV manager's one answer to the scheduler: ``num_new_pages`` pages given per pool name,
    ``num_cached_tokens`` tokens the cache already held (an admission: prefix pages in any tier,
    or a swapped-out sequence's pages), and the page ``copies`` ``(source, destination)`` per pool
    name the next step performs before it writes (a fork's copy-on-write)."""

    num_new_pages: dict[str, int]
    num_cached_tokens: int = 0
    copies: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PrefixCounters:
    """The prefix cache's queries and hits since start: tokens, and pages found per tier over every pool."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    device_pages: int = 0
    host_pages: int = 0
    disk_pages: int = 0

    def count(self, hit: PrefixHit, num_tokens: int, from_disk: int) -> None:
        """A sequence of ``num_tokens`` tokens admitted on ``hit`` (``from_disk`` of its pages below
        the device came from disk)."""
        pages = [page for sources in hit.pages.values() for page in sources if page != NULL_PAGE]
        below = sum(isinstance(page, HostSource) for page in pages)
        self.queried_tokens += num_tokens
        self.hit_tokens += hit.num_tokens
        self.device_pages += len(pages) - below
        self.host_pages += below - from_disk
        self.disk_pages += from_disk


@dataclasses.dataclass(frozen=True)
class Usage:
    """Pages in use now over every pool, and their bytes."""

    pages: int
    bytes: int


class KVCacheManager:
    """The page pools of one engine, its prefix cache (``prefix_caching``: full pages are
    registered by the hash chain of their tokens and shared by later sequences), its tiers below
    the device (``tiers``: the host tier of ``host_bytes``, 0: none; the disk tier ``disk``, None:
    none) and its page budgets (``compaction``; ``budget``: the full pool's pages per sequence,
    None: unbounded). ``preemption``: 'auto' (swap when ``TierManager.swap_pays``), 'swap'
    (whenever the host tier has room) or 'recompute'; a cache with per-row state outside the pages
    (``sizes.state_bytes``: recurrent states, evicted K/V) is always recomputed."""

    def __init__(
        self,
        sizes: PoolSizes,
        prefix_caching: bool,
        host_bytes: int = 0,
        preemption: str = "auto",
        disk: DiskTier | None = None,
        budget: PageBudget | None = None,
    ):
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        self.pools: list[PagePool] = []
        if sizes.full_pages:
            self.pools.append(PagePool(PageManager(sizes.full_pages, sizes.page_size), None, sizes.full_page_bytes))
        if sizes.sliding_pages:
            manager = PageManager(sizes.sliding_pages, sizes.page_size)
            self.pools.append(PagePool(manager, sizes.window, sizes.sliding_page_bytes))
        self.page_size = sizes.page_size
        self.prefix_caching = prefix_caching
        self.tiers = TierManager(host_bytes, "recompute" if sizes.state_bytes else preemption, disk)
        self.compaction = CompactionPlanner(budget, prefix_caching)
        self._hits = PrefixCounters()
        # Per pool name: the owners whose pages changed in place since the last take_edits, each with
        # the first logical page that changed (appends, pages a window left, compactions).
        self._edits: dict[str, dict[Owner, int]] = {pool.name: {} for pool in self.pools}

    # --- what a request needs, checked when it arrives -----------------------------------------------
    def check_fits(self, num_prompt: int, num_tokens: int, n: int, chunk_tokens: int) -> None:
        """Refuse a request the pools could never hold, even alone: ``n`` sequences of
        ``num_tokens`` tokens (they share the prompt's full pages), each step writing up to
        ``chunk_tokens`` tokens of it."""
        for pool in self.pools:
            pages = -(-num_tokens // pool.page_size)
            if pool.window is None:  # under a budget its most, and fresh pages to compact into
                pages = self.compaction.fit_pages(num_prompt, pages)
            else:  # what one step reads and writes: the window and a chunk
                pages = min(pages, -(-(pool.window - 1 + chunk_tokens) // pool.page_size) + 1)
            needed = pages + (n - 1) * max(pages - (num_prompt - 1) // pool.page_size, 1)
            if needed > pool.manager.num_usable:
                raise RequestError(
                    f"add_request: {n} sequence(s) of {num_tokens} tokens need {needed} pages of the {pool.name} "
                    f"pool, which holds {pool.manager.num_usable}; raise kv_memory or lower max_tokens",
                    "max_tokens",
                )

    # --- the scheduler's questions ------------------------------------------------------------------
    def lookup(self, seq: SequenceState) -> PrefixHit:
        """A swapped-out sequence's pages when they are all still there (``swap_out``); else the
        longest chain of ``seq``'s full pages that every pool still holds, in any tier, leaving
        at least its last token to compute (its logits draw the next). Changes nothing."""
        swapped = self.tiers.swapped.get(seq.key)
        resumed = None if swapped is None else self._resume_hit(seq, swapped)
        if resumed is not None:
            return resumed
        if not self.prefix_caching:
            return NO_HIT
        num_pages = self.compaction.admitted_pages(seq, (seq.num_tokens - 1) // self.page_size)
        hashes = self._chain(seq, num_pages)
        held = [pool.held_pages(hashes, self.tiers.below) for pool in self.pools]  # one question per page and pool
        missing = [list(itertools.accumulate((source is None for source in sources), initial=0)) for sources in held]
        for end in range(num_pages, 0, -1):  # the longest prefix whose needed pages every pool holds
            firsts = [pool.first_needed_page(end * self.page_size) for pool in self.pools]
            if all(gaps[end] == gaps[first] for gaps, first in zip(missing, firsts)):
                pages = {
                    pool.name: [NULL_PAGE] * first + sources[first:end]
                    for pool, sources, first in zip(self.pools, held, firsts)
                }
                return PrefixHit(pages, end * self.page_size)
        return NO_HIT

    def allocate(self, seq: SequenceState, num_new_tokens: int, hit: PrefixHit | None = None) -> Allocation | None:
        """Room for ``seq``'s next ``num_new_tokens`` tokens in every pool, after the tokens it has
        computed (or, for a sequence being admitted, after the ``hit``, whose device pages it now
        shares and whose pages below the device come back into fresh pages). None, and nothing
        changed, when a pool is short of pages."""
        if hit is not None:
            return self._admit(seq, num_new_tokens, hit)
        for pool in self.pools:  # pages a window has left go first: they may be what the others need
            self._drop_leading(pool, seq, seq.num_computed)
        end = seq.num_computed + num_new_tokens
        if self.compaction.over(seq, end):
            return self._compact(seq, num_new_tokens)
        needed = {pool.name: self._pages_needed(pool, seq, end) for pool in self.pools}
        if not all(pool.manager.can_allocate(needed[pool.name]) for pool in self.pools):
            return None
        for pool in self.pools:
            self._demote_evictions(pool, needed[pool.name])
            self._allocate(pool, seq, needed[pool.name])
        return Allocation(needed)

    def room(self, seq: SequenceState, count: int, hit: PrefixHit | None = None) -> int:
        """How many of ``count`` next tokens ``seq`` may compute this step under the page budget
        (being admitted on ``hit``, or running): ``CompactionPlanner.room``."""
        if hit is None:
            return self.compaction.room(seq, count)
        return self.compaction.room(seq, count, hit.num_tokens, hit.resumes)

    def holds_budgets(self, running: Sequence[SequenceState], seq: SequenceState) -> bool:
        """May ``seq`` join the ``running`` sequences? Under a page budget: only while the full pool
        holds the most pages each of them may come to hold, so no row outgrows the pool (a
        sequence at its budget is preempted by recompute, which repeats its compactions: admitting
        more rows than the pool holds budgets thrashes). Always without a budget (rows are
        admitted on their next chunk and growth preempts, vLLM's rule), and always into an empty
        engine (``check_fits`` refused what the pool never holds)."""
        full_pages = sum(pool.manager.num_usable for pool in self.pools if pool.window is None)
        return self.compaction.holds(running, seq, full_pages)

    def fork(self, parent: SequenceState, child: SequenceState) -> Allocation | None:
        """``child`` starts on ``parent``'s computed prompt: it shares the full pages of all but the
        prompt's last token and gets a copy of the page that token sits in (copy-on-write; it
        recomputes that token to draw its own first one). None, and nothing changed, when a pool
        has no page for the copy or the parent was compacted (its pages no longer hold the
        prompt's tokens in order)."""
        if parent.key in self.compaction.compacted:
            return None
        shared = len(child.prompt) - 1
        partial = 1 if shared % self.page_size else 0
        if not all(pool.manager.can_allocate(partial) for pool in self.pools):
            return None
        copies = {}
        for pool in self.pools:
            self._demote_evictions(pool, partial)
            copies[pool.name] = pool.manager.fork(parent.key, child.key, shared)
        child.page_hashes = list(parent.page_hashes[: shared // self.page_size])
        child.num_registered = min(parent.num_registered, shared // self.page_size)
        return Allocation({pool.name: len(copies[pool.name]) for pool in self.pools}, copies=copies)

    def swap_out(self, seq: SequenceState) -> bool:
        """Preempt a running ``seq`` by swap (``TierManager.swap_out``: if that pays and the host tier
        has room): its pages the prefix cache does not hold are copied to the host tier (pinned)
        before the next step, and all its device pages are freed. False, and nothing changed but
        pages a window had left, when it is to be recomputed instead (also when it is compacted in
        this step: a swap would copy out its pages before the compaction is made)."""
        if not self.tiers.may_swap(seq) or self.compaction.compacting(seq.key):
            return False
        for pool in self.pools:
            self._drop_leading(pool, seq, seq.num_computed)
        registered = seq.num_registered
        tails = {
            pool.name: Tail(pool.manager.pages(seq.key)[registered:], registered, pool.page_bytes)
            for pool in self.pools
        }
        if not self.tiers.swap_out(seq, tails, seq.num_computed - registered * self.page_size):
            return False
        self._free_device(seq)
        return True

    def computed(self, seq: SequenceState) -> None:
        """``seq``'s computed tokens grew: offer its newly full pages to the prefix cache (and so to
        the tiers below: ``TierManager.registered``)."""
        if not self.prefix_caching or seq.key in self.compaction.compacted:
            return
        full = seq.num_computed // self.page_size
        hashes = self._chain(seq, full)
        for pool in self.pools:
            pages = pool.manager.pages(seq.key)
            for logical in range(seq.num_registered, full):
                if pages[logical] != NULL_PAGE and pool.manager.register(pages[logical], hashes[logical]):
                    key = prefix_key(pool.name, hashes[logical])
                    self.tiers.registered(pool.name, pool.page_bytes, pages[logical], key)
        seq.num_registered = full

    def free(self, seq: SequenceState) -> None:
        """Release every page of ``seq`` (tail first; cached pages stay findable until reused) and
        its swapped pages."""
        self._free_device(seq)
        self.tiers.forget_swap(seq.key)
        self.compaction.forget(seq.key)

    def take_moves(self) -> PageMoves:
        """The copies and compactions decided since the last call; the engine makes them before the
        next step runs."""
        return self.tiers.take_moves(self.compaction.take())

    def persist(self, moves: PageMoves) -> None:
        """Save the pages ``moves`` read for the disk tier, once the step made them (``TierManager.save``)."""
        self.tiers.save(moves.persist)

    def take_edits(self) -> dict[str, dict[Owner, int]]:
        """Per pool name, the owners whose pages changed since the last call (pages appended, pages a
        window left, a compaction), each with the first logical page that changed: its pages from
        there on are new. An owner that gained its pages from none (an admission, a fork) may be
        missing (``jaxkv.serving.plan`` sends a row that changed hands whole)."""
        edits, self._edits = self._edits, {pool.name: {} for pool in self.pools}
        return edits

    # --- helpers ------------------------------------------------------------------------------------
    def _pages_needed(self, pool: PagePool, seq: SequenceState, end: int) -> int:
        """Pages ``pool`` gives ``seq`` to hold its tokens up to position ``end``."""
        return pool.pages_needed(seq, end - (self.shift(seq) if pool.window is None else 0))

    def _compact(self, seq: SequenceState, num_new_tokens: int) -> Allocation | None:
        """``allocate`` for a running ``seq`` over its budget: plan its compaction into
        ``max_pages - 1`` pages (sources: its full-pool pages), then pages for the new tokens."""
        full = self._pool(FULL_POOL)
        keep_pages = self.compaction.budget.max_pages - 1
        end = seq.num_computed + num_new_tokens
        prompt_pages = self.compaction.prompt_pages(seq)
        fresh = full.manager.compaction_fresh_pages(seq.key, keep_pages, prompt_pages)
        extra = self.compaction.extra_pages(num_new_tokens)
        needed = {pool.name: self._pages_needed(pool, seq, end) for pool in self.pools if pool is not full}
        needed[full.name] = extra
        taken = {**needed, full.name: fresh + extra}
        if not all(pool.manager.can_allocate(taken[pool.name]) for pool in self.pools):
            return None
        for pool in self.pools:
            self._demote_evictions(pool, taken[pool.name])
        sources, destinations = full.manager.compact(seq.key, keep_pages, prompt_pages)
        self._edited(full, seq.key, 0)
        self.compaction.plan(seq, sources, destinations)
        seq.num_registered = 0
        for pool in self.pools:
            self._allocate(pool, seq, needed[pool.name])
        return Allocation(needed)

    def _admit(self, seq: SequenceState, num_new_tokens: int, hit: PrefixHit) -> Allocation | None:
        """``allocate`` for a sequence admitted on ``hit``: share its device pages (placeholders for
        its pages below the device), then fresh pages for those and the new tokens."""
        for pool in self.pools:
            sources = hit.pages.get(pool.name, [])
            pool.manager.share(seq.key, [NULL_PAGE if isinstance(page, HostSource) else page for page in sources])
            self._drop_leading(pool, seq, hit.num_tokens)
        promoted = {pool.name: hit.below(pool) for pool in self.pools}
        if not hit.resumes:  # computed again from the start: no compaction holds
            self.compaction.forget(seq.key)
        end = hit.num_tokens + num_new_tokens
        new = {pool.name: self._pages_needed(pool, seq, end) for pool in self.pools}
        if not all(pool.manager.can_allocate(new[pool.name] + len(promoted[pool.name])) for pool in self.pools):
            self._free_device(seq)
            return None
        taken = self.tiers.take({name: [source.key for _, source in found] for name, found in promoted.items()})
        if taken is None:
            self._free_device(seq)
            return None
        host_pages, from_disk = taken
        for pool in self.pools:  # the host pages are out of the tier before demotions make room there
            self._demote_evictions(pool, len(promoted[pool.name]) + new[pool.name])
            self._promote(pool, seq, promoted[pool.name], host_pages[pool.name])
            self._allocate(pool, seq, new[pool.name])
        if not hit.resumes and self.prefix_caching:
            self._hits.count(hit, seq.num_tokens, from_disk)
        self.tiers.forget_swap(seq.key)  # promoted, or (a hit that does not resume) of no use any more
        seq.num_registered = hit.num_tokens // self.page_size if self.prefix_caching else 0
        return Allocation(new, hit.num_tokens)

    def _promote(
        self, pool: PagePool, seq: SequenceState, found: list[tuple[int, HostSource]], host_pages: list[HostPage]
    ) -> None:
        """Fresh pages at ``seq``'s logical pages of ``found`` (registered under their hashes: the
        prefix cache holds them on the device again), each written from its host page before the next step."""
        fresh = pool.manager.allocate_at(seq.key, [logical for logical, _ in found])
        for page, (_, source), host_page in zip(fresh, found, host_pages, strict=True):
            if source.page_hash is not None:
                pool.manager.register(page, source.page_hash)
            self.tiers.write(pool.name, host_page, page)

    def _resume_hit(self, seq: SequenceState, swapped: Swapped) -> PrefixHit | None:
        """The pages a swapped-out sequence resumes from: its registered pages found by hash (any
        tier), then its swapped pages; None when some registered page is gone from every tier."""
        pages = {}
        for pool in self.pools:
            first = min(pool.first_needed_page(swapped.num_tokens), swapped.num_registered)
            prefix = pool.cached_pages(seq.page_hashes, first, swapped.num_registered, self.tiers.below)
            if prefix is None:
                return None
            pages[pool.name] = [NULL_PAGE] * first + prefix + swapped.pages[pool.name]
        return PrefixHit(pages, swapped.num_tokens, resumes=True)

    def _allocate(self, pool: PagePool, seq: SequenceState, n: int) -> None:
        """Append ``n`` fresh pages to ``seq``'s pages in ``pool``."""
        if pool.manager.allocate(seq.key, n):
            self._edited(pool, seq.key, len(pool.manager.pages(seq.key)) - n)

    def _drop_leading(self, pool: PagePool, seq: SequenceState, position: int) -> None:
        """Release ``seq``'s pages of ``pool`` that a query at ``position`` no longer reads
        (``NULL_PAGE`` in their place)."""
        first = pool.first_needed_page(position)
        if not first:
            return
        leading = pool.manager.pages(seq.key)[:first]
        if leading.count(NULL_PAGE) == len(leading):
            return
        self._edited(pool, seq.key, next(logical for logical, page in enumerate(leading) if page != NULL_PAGE))
        pool.manager.drop_leading(seq.key, first)

    def _edited(self, pool: PagePool, owner: Owner, first: int) -> None:
        """``owner``'s pages in ``pool`` changed from logical page ``first`` on (``take_edits``)."""
        edits = self._edits[pool.name]
        edits[owner] = min(first, edits.get(owner, first))

    def _demote_evictions(self, pool: PagePool, n: int) -> None:
        """Before ``n`` pages are taken from ``pool``: the cached pages that evicts go to the host tier."""
        self.tiers.demote(pool.name, pool.page_bytes, pool.manager.evictions(n))

    def _free_device(self, seq: SequenceState) -> None:
        for pool in self.pools:
            pool.manager.free(seq.key)
        seq.num_registered = 0

    def _pool(self, name: str) -> PagePool:
        return next(pool for pool in self.pools if pool.name == name)

    def _chain(self, seq: SequenceState, num_pages: int) -> list[bytes]:
        """The hash chain of ``seq``'s first ``num_pages`` full pages (extended as it grows)."""
        have = len(seq.page_hashes)
        if num_pages > have:
            parent = seq.page_hashes[-1] if have else None
            tokens = seq.tokens[have * self.page_size : num_pages * self.page_size]
            seq.page_hashes += page_hashes(tokens, self.page_size, salt_key(seq.options.cache_salt), parent)
        return seq.page_hashes[:num_pages]

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant over every tier: each ledger's,
        the tiers' (``TierManager.check``), swapped-out sequences holding no device page; under a
        page budget, no sequence over it and no compacted sequence's page in the prefix cache.
        O(pools + host tier)."""
        for pool in self.pools:
            pool.manager.check()
        self.tiers.check(lambda key: self._pool(key[0]).manager.cached(key[1]) is not None)
        holding = [owner for owner in self.tiers.swapped if any(pool.manager.pages(owner) for pool in self.pools)]
        if holding:
            raise AssertionError(f"swapped-out owners {holding} still hold device pages")
        if self.compaction.budget is not None:
            manager = self._pool(FULL_POOL).manager
            self.compaction.check({owner: manager.pages(owner) for owner in manager.owners()}, manager.page_hash)

    # --- what the model runner and the metrics read ---------------------------------------------------
    def table_widths(self, max_model_len: int) -> dict[str, int]:
        """Block-table columns per pool name for sequences of up to ``max_model_len`` tokens: a
        budgeted full pool's rows hold at most what a compaction reads."""
        widths = {}
        for pool in self.pools:
            length = self.compaction.table_length(max_model_len) if pool.window is None else max_model_len
            widths[pool.name] = table_width(length, pool.page_size)
        return widths

    def pages(self, pool: str, seq: SequenceState) -> list[int]:
        """``seq``'s pages in the pool named ``pool`` by logical page (``NULL_PAGE`` where a window
        left one; none for a sequence without pages)."""
        return self._pool(pool).manager.pages(seq.key)

    def shift(self, seq: SequenceState) -> int:
        """How far the positions of ``seq``'s new tokens run ahead of their full-pool slots (its
        row's entry of ``PackedBatch.shifts`` under a page budget)."""
        return self.compaction.shift(seq.key)

    def usage(self) -> Usage:
        return Usage(
            sum(pool.manager.num_used for pool in self.pools),
            sum(pool.manager.num_used * pool.page_bytes for pool in self.pools),
        )

    def wasted_slots(self, running: Sequence[SequenceState]) -> tuple[int, int]:
        """``(allocated, unused)`` slots of the running sequences' pages in the first pool (the
        full-attention pool when the model has one); none when nothing is paged."""
        if not self.pools:
            return 0, 0
        pool = self.pools[0]
        allocated = unused = 0
        for seq in running:
            slots = sum(page != NULL_PAGE for page in pool.manager.pages(seq.key)) * pool.page_size
            allocated += slots
            unused += max(slots - seq.num_computed + (self.shift(seq) if pool.window is None else 0), 0)
        return allocated, unused

    def copied_pages(self) -> int:
        """The most pages one step may copy in a pool between the device and a tier below: the
        largest pool's pages; 0 without a tier below (nothing is copied)."""
        return max((pool.manager.num_pages for pool in self.pools), default=0) if self.tiers.on else 0

    @property
    def num_compactions(self) -> int:
        """Compactions planned since start."""
        return self.compaction.num_compactions

    def pool_stats(self) -> dict[str, PoolStats]:
        """Each pool's pages now, by pool name."""
        return {pool.name: PoolStats(**pool.manager.usage(), page_bytes=pool.page_bytes) for pool in self.pools}

    def prefix_stats(self) -> PrefixCacheStats:
        """The prefix cache's queries and hits since start."""
        return PrefixCacheStats(self._hits.queried_tokens, self._hits.hit_tokens)

    def tier_stats(self) -> dict[str, TierStats]:
        """Each tier's ``TierStats`` by name: 'device' (the pools), 'host' and 'disk'."""
        hits, used = self._hits, self.usage()
        capacity = sum(pool.manager.num_usable * pool.page_bytes for pool in self.pools)
        return {
            "device": TierStats(used.pages, used.bytes, capacity, hits.device_pages),
            "host": self.tiers.host_stats(hits.host_pages),
            "disk": self.tiers.disk_stats(hits.disk_pages),
        }
