"""KV-cache management: the page pools' ledgers, the prefix cache and the host tier, behind the
few questions the scheduler asks (vLLM's ``KVCacheManager``).

Each pool (the full-attention layers; the sliding-window layers) has its own ``PageManager``
and block table. The scheduler never touches a page: it asks for room for a sequence's next
tokens (``allocate``, with the prefix the cache holds for a new sequence from ``lookup``), for a
fork of a computed prompt (``fork``), to swap out a preempted sequence (``swap_out``), and hands
back what finished (``free``); each answer is one ``Allocation``, or None when there is no room
(and then nothing changed).

With a host tier (``host_kv_memory``, ``jaxkv.serving.host_tier``) pages leave the device pools
without being lost: a cached page that an allocation evicts is demoted to host memory, and a
prefix hit may find pages there, promoted into fresh device pages (registered under their hash
again: a page lives in one tier at a time). A preempted sequence may be swapped out: its pages
that the prefix cache does not hold go to the host tier, pinned, and come back when it resumes.
The KV manager decides every move while the scheduler runs; the bytes move once per step, before
it runs (``take_moves``: all reads from the device first, then all writes to it).

With a disk tier (``kv_cache_dir``, ``jaxkv.serving.disk_link``) every page the prefix cache
registers is also written to disk once (read from the device with the step's other reads, saved
by the engine after them), so a restarted engine finds its prefixes there: a prefix hit may find
pages on disk, read back into fresh device pages like host pages. A page already on disk is not
written again; a page gone from disk between the lookup and the admission (another engine's size
limit, a file refused as corrupt) makes the admission wait for the next lookup.

Swap or recompute (``swap_pays``): preempting by recompute costs the tokens the prefix cache will
not serve again, ``num_computed - num_registered * page_size`` (the registered pages stay cached in
either case); swapping costs a round trip of the pages holding them to host memory. Swap when
``tokens >= PAGE_COPY_TOKENS * pages``: a page's round trip is priced like recomputing
``PAGE_COPY_TOKENS`` tokens. So a sequence whose unregistered tail is one page holding a token or two
is recomputed, a long tail (no prefix caching: every page) is swapped.

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
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.layers.paged import FULL_POOL, NULL_PAGE, pool_name, table_width
from jaxkv.serving.compaction import MAX_COMPACTIONS, Compaction, PageBudget
from jaxkv.serving.disk_link import DiskTier
from jaxkv.serving.host_tier import HostKey, HostPage, HostTier
from jaxkv.serving.pages import Owner, PageManager, page_hashes, salt_key
from jaxkv.serving.requests import RequestError, SequenceState
from jaxkv.serving.sizing import PoolSizes

# Recomputed tokens a page's round trip to host memory is priced at (see the module docstring). A page
# of a 1B-parameter float32 model with 16 tokens holds ~1 MiB: 2 x 1 MiB over PCIe (~25 GB/s) is ~80 us,
# recomputing one token ~2 GFLOP, ~20-40 us on a GPU: about two tokens. On a CPU the copy is a memcpy.
PAGE_COPY_TOKENS = 2
PREEMPTION_MODES = ("auto", "swap", "recompute")


@dataclasses.dataclass(frozen=True)
class HostSource:
    """A page of a hit that lives in the host tier: its ``key`` there, and the hash it is cached under
    once back in a device page (None: a swapped page, which the prefix cache does not hold)."""

    key: HostKey
    page_hash: bytes | None


PageSource = int | HostSource  # a device page, or a page in the host tier


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


def prefix_key(pool: str, page_hash: bytes) -> HostKey:
    """The host tier's key of a prefix page: its pool and hash (the hash chain includes the salt)."""
    return (pool, page_hash)


def swap_key(pool: str, owner: Owner, logical: int) -> HostKey:
    """The host tier's key of a swapped page: its pool, owner and logical page."""
    return (pool, owner, logical)


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The longest prefix of a sequence the cache holds in every pool: ``pages`` per pool name
    (empty: none; ``NULL_PAGE`` where a window no longer reads), ``num_tokens`` tokens of it.
    ``resumes``: the hit is a swapped-out sequence's pages (``swap_out``)."""

    pages: dict[str, list[PageSource]]
    num_tokens: int
    resumes: bool = False


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


@dataclasses.dataclass
class TierStats:
    """Prefix-cache hits per tier: pages found, over every pool."""

    device_hit_pages: int = 0
    host_hit_pages: int = 0
    disk_hit_pages: int = 0


@dataclasses.dataclass(frozen=True)
class Usage:
    """Pages in use now over every pool, and their bytes."""

    pages: int
    bytes: int


class KVCacheManager:
    """The page pools of one engine, its prefix cache (``prefix_caching``: full pages are
    registered by the hash chain of their tokens and shared by later sequences) and its host tier
    (``host_bytes``; 0: none) and disk tier (``disk``; None: none). ``preemption``: 'auto' (swap
    when ``swap_pays``), 'swap' (whenever the host tier has room) or 'recompute'; a cache with
    per-row state outside the pages (``sizes.state_bytes``: recurrent states, evicted K/V) is
    always recomputed. ``budget``: the full pool's pages per sequence (None: unbounded)."""

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
        self.host = HostTier(host_bytes)
        self.disk = disk
        self.preemption = "recompute" if sizes.state_bytes else preemption
        self.swapped: dict[Owner, Swapped] = {}
        self.stats = TierStats()
        self.budget = budget
        # A compacted sequence's shift: its full-pool slot s past the compaction's holds position
        # s + shift (the pool keeps the positions of the slots before, PagedLayer.slot_positions).
        self.compacted: dict[Owner, int] = {}
        self.num_compactions = 0  # planned since start
        self._moves = PageMoves()
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
            if pool.window is None and self.budget is not None:  # its most, and fresh pages to compact into
                held = -(-self.budget.limit_for(num_prompt, compacted=False) // pool.page_size)
                pages = min(pages, held + self.budget.max_pages)
            if pool.window is not None:  # what one step reads and writes: the window and a chunk
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
        longest chain of ``seq``'s full pages that every pool still holds, in either tier, leaving
        at least its last token to compute (its logits draw the next). Changes nothing."""
        swapped = self.swapped.get(seq.key)
        resumed = None if swapped is None else self._resume_hit(seq, swapped)
        if resumed is not None:
            return resumed
        if not self.prefix_caching:
            return NO_HIT
        num_pages = (seq.num_tokens - 1) // self.page_size
        if self.budget is not None:  # admitted below its budget (compactions are the running sequences')
            num_pages = min(num_pages, (self._limit(seq) - 1) // self.page_size)
        hashes = self._chain(seq, num_pages)
        held = [pool.held_pages(hashes, self._below) for pool in self.pools]  # one question per page and pool
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
        shares and whose host pages come back into fresh pages). None, and nothing changed, when a
        pool is short of pages."""
        if hit is not None:
            return self._admit(seq, num_new_tokens, hit)
        for pool in self.pools:  # pages a window has left go first: they may be what the others need
            self._drop_leading(pool, seq, seq.num_computed)
        end = seq.num_computed + num_new_tokens
        if self.budget is not None and end - self.shift(seq) > self._limit(seq):
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
        (being admitted on ``hit``, or running): up to its budget; at its budget a running sequence
        compacts first (a chunk then fits the page the compaction leaves), or waits (0) when the
        step's compactions are used up; a sequence resumed at its budget (swapped out there) takes
        its pages back with no tokens (0): running, it compacts in the next step."""
        if self.budget is None:
            return count
        start = seq.num_computed if hit is None else hit.num_tokens
        slots = start - (self.shift(seq) if hit is None or hit.resumes else 0)
        limit = self._limit(seq)
        if slots < limit:
            return min(count, limit - slots)
        if hit is not None or len(self._moves.compactions) >= MAX_COMPACTIONS:
            return 0
        return min(count, self.budget.limit - self.budget.keep_slots)

    def holds_budgets(self, running: Sequence[SequenceState], seq: SequenceState) -> bool:
        """May ``seq`` join the ``running`` sequences? Under a page budget: only while the full pool
        holds the most pages each of them may come to hold (``_most_pages``), so no row outgrows
        the pool (a sequence at its budget is preempted by recompute, which repeats its
        compactions: admitting more rows than the pool holds budgets thrashes). Always without a
        budget (rows are admitted on their next chunk and growth preempts, vLLM's rule), and
        always into an empty engine (``check_fits`` refused what the pool never holds)."""
        if self.budget is None or not running:
            return True
        most = sum(self._most_pages(other) for other in [*running, seq])
        return most <= self._pool(FULL_POOL).manager.num_usable

    def fork(self, parent: SequenceState, child: SequenceState) -> Allocation | None:
        """``child`` starts on ``parent``'s computed prompt: it shares the full pages of all but the
        prompt's last token and gets a copy of the page that token sits in (copy-on-write; it
        recomputes that token to draw its own first one). None, and nothing changed, when a pool
        has no page for the copy or the parent was compacted (its pages no longer hold the
        prompt's tokens in order)."""
        if parent.key in self.compacted:
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
        """Preempt a running ``seq`` by swap if that pays (``swap_pays``, unless ``preemption`` says)
        and the host tier has room: its pages the prefix cache does not hold are copied to the host
        tier (pinned) before the next step, and all its device pages are freed. False, and nothing
        changed but pages a window had left, when it is to be recomputed instead."""
        if self.preemption == "recompute" or not seq.num_computed or not self.host.capacity:
            return False
        if self._compacting(seq):
            return False  # a swap would copy out its pages before the compaction is made
        for pool in self.pools:
            self._drop_leading(pool, seq, seq.num_computed)
        registered = seq.num_registered
        tails = {pool.name: pool.manager.pages(seq.key)[registered:] for pool in self.pools}
        num_pages = sum(page != NULL_PAGE for tail in tails.values() for page in tail)
        nbytes = sum(sum(page != NULL_PAGE for page in tails[pool.name]) * pool.page_bytes for pool in self.pools)
        tokens = seq.num_computed - registered * self.page_size
        pays = self.preemption == "swap" or self.swap_pays(tokens, num_pages)
        if not pays or not self.host.can_pin(nbytes):
            return False
        pages = {pool.name: self._swap_pages(pool, seq, tails[pool.name], registered) for pool in self.pools}
        self.swapped[seq.key] = Swapped(seq.num_computed, registered, pages)
        self._free_device(seq)
        return True

    @staticmethod
    def swap_pays(tokens: int, pages: int) -> bool:
        """The cost rule: swapping ``pages`` (out and back) beats recomputing ``tokens``."""
        return tokens >= PAGE_COPY_TOKENS * pages

    def computed(self, seq: SequenceState) -> None:
        """``seq``'s computed tokens grew: offer its newly full pages to the prefix cache (a host
        copy of a page it registers is dropped: a page lives in one tier) and to the disk tier."""
        if not self.prefix_caching or seq.key in self.compacted:
            return
        full = seq.num_computed // self.page_size
        hashes = self._chain(seq, full)
        for pool in self.pools:
            pages = pool.manager.pages(seq.key)
            for logical in range(seq.num_registered, full):
                if pages[logical] != NULL_PAGE and pool.manager.register(pages[logical], hashes[logical]):
                    key = prefix_key(pool.name, hashes[logical])
                    self.host.discard(key)
                    self._persist(pool, pages[logical], key)
        seq.num_registered = full

    def free(self, seq: SequenceState) -> None:
        """Release every page of ``seq`` (tail first; cached pages stay findable until reused) and
        its swapped pages."""
        self._free_device(seq)
        self._forget_swap(seq)
        self.compacted.pop(seq.key, None)

    def take_moves(self) -> PageMoves:
        """The copies decided since the last call; the engine makes them before the next step runs."""
        moves, self._moves = self._moves, PageMoves()
        return moves

    def take_edits(self) -> dict[str, dict[Owner, int]]:
        """Per pool name, the owners whose pages changed since the last call (pages appended, pages a
        window left, a compaction), each with the first logical page that changed: its pages from
        there on are new. An owner that gained its pages from none (an admission, a fork) may be
        missing (``jaxkv.serving.plan`` sends a row that changed hands whole)."""
        edits, self._edits = self._edits, {pool.name: {} for pool in self.pools}
        return edits

    # --- helpers ------------------------------------------------------------------------------------
    def _compacting(self, seq: SequenceState) -> bool:
        """Is ``seq`` compacted in this step (its pages are read before the step's compactions are made)?"""
        return any(compaction.owner == seq.key for compaction in self._moves.compactions)

    def _limit(self, seq: SequenceState) -> int:
        """Full-pool slots ``seq`` may hold before its next compaction (``PageBudget.limit_for``)."""
        return self.budget.limit_for(len(seq.prompt), seq.key in self.compacted)

    def _most_pages(self, seq: SequenceState) -> int:
        """Full-pool pages ``seq`` may come to hold: its limit (``_limit``), or all its tokens when
        its prompt and ``max_tokens`` take fewer; before its first compaction, with the fresh pages
        that compaction takes for its cached prompt pages (``_compact``)."""
        length = len(seq.prompt) + seq.options.max_tokens
        slots = min(self._limit(seq), length)
        pages = -(-slots // self.page_size)
        if slots < length and self.prefix_caching and seq.key not in self.compacted:
            pages += min(self._prompt_pages(seq), self.budget.max_pages - 1)
        return pages

    def _prompt_pages(self, seq: SequenceState) -> int:
        """Full pages of ``seq``'s prompt: a compaction copies them when cached (they stay in the
        prefix cache) and overwrites its later pages in place."""
        return len(seq.prompt) // self.page_size

    def _pages_needed(self, pool: PagePool, seq: SequenceState, end: int) -> int:
        """Pages ``pool`` gives ``seq`` to hold its tokens up to position ``end``."""
        return pool.pages_needed(seq, end - (self.shift(seq) if pool.window is None else 0))

    def _compact(self, seq: SequenceState, num_new_tokens: int) -> Allocation | None:
        """``allocate`` for a running ``seq`` over its budget: plan its compaction into
        ``max_pages - 1`` pages (sources: its full-pool pages), then pages for the new tokens."""
        budget, full = self.budget, self._pool(FULL_POOL)
        keep_pages = budget.max_pages - 1
        end = seq.num_computed + num_new_tokens
        prompt_pages = self._prompt_pages(seq)
        fresh = full.manager.compaction_fresh_pages(seq.key, keep_pages, prompt_pages)
        extra = -(-(budget.keep_slots + num_new_tokens) // self.page_size) - keep_pages
        needed = {pool.name: self._pages_needed(pool, seq, end) for pool in self.pools if pool is not full}
        needed[full.name] = extra
        taken = {**needed, full.name: fresh + extra}
        if not all(pool.manager.can_allocate(taken[pool.name]) for pool in self.pools):
            return None
        filled = seq.num_computed - self.shift(seq)
        for pool in self.pools:
            self._demote_evictions(pool, taken[pool.name])
        sources, destinations = full.manager.compact(seq.key, keep_pages, prompt_pages)
        self._edited(full, seq.key, 0)
        self._moves.compactions.append(Compaction(seq.key, sources, destinations, filled, seq.num_computed))
        self.num_compactions += 1
        self.compacted[seq.key] = seq.num_computed - budget.keep_slots
        seq.num_registered = 0
        for pool in self.pools:
            self._allocate(pool, seq, needed[pool.name])
        return Allocation(needed)

    def _admit(self, seq: SequenceState, num_new_tokens: int, hit: PrefixHit) -> Allocation | None:
        """``allocate`` for a sequence admitted on ``hit``: share its device pages (placeholders for
        its host pages), then fresh pages for the host pages and the new tokens."""
        for pool in self.pools:
            sources = hit.pages.get(pool.name, [])
            pool.manager.share(seq.key, [NULL_PAGE if isinstance(page, HostSource) else page for page in sources])
            self._drop_leading(pool, seq, hit.num_tokens)
        promoted = {pool.name: self._host_sources(pool, hit) for pool in self.pools}
        if not hit.resumes:  # computed again from the start: no compaction holds
            self.compacted.pop(seq.key, None)
        end = hit.num_tokens + num_new_tokens
        new = {pool.name: self._pages_needed(pool, seq, end) for pool in self.pools}
        if not all(pool.manager.can_allocate(new[pool.name] + len(promoted[pool.name])) for pool in self.pools):
            self._free_device(seq)
            return None
        from_disk = self._load_from_disk(promoted)
        if from_disk is None:
            self._free_device(seq)
            return None
        taken = {
            name: [from_disk.get(source.key) or self.host.promote(source.key) for _, source in found]
            for name, found in promoted.items()
        }
        for pool in self.pools:  # the host pages are out of the tier before demotions make room there
            self._demote_evictions(pool, len(promoted[pool.name]) + new[pool.name])
            self._promote(pool, seq, promoted[pool.name], taken[pool.name])
            self._allocate(pool, seq, new[pool.name])
        if not hit.resumes:
            self._count_hit(hit, len(from_disk))
        self._forget_swap(seq)  # promoted, or (a hit that does not resume) of no use any more
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
            self._moves.into.setdefault(pool.name, []).append((host_page, page))

    def _host_sources(self, pool: PagePool, hit: PrefixHit) -> list[tuple[int, HostSource]]:
        """``(logical page, source)`` of the hit's pages in the host tier that ``pool`` still reads."""
        first = pool.first_needed_page(hit.num_tokens)
        sources = hit.pages.get(pool.name, [])
        return [
            (logical, page) for logical, page in enumerate(sources) if isinstance(page, HostSource) and logical >= first
        ]

    def _count_hit(self, hit: PrefixHit, from_disk: int) -> None:
        """Count a prefix hit's pages per tier (``from_disk`` of its pages below the device came from disk)."""
        pages = [page for sources in hit.pages.values() for page in sources if page != NULL_PAGE]
        below = sum(isinstance(page, HostSource) for page in pages)
        self.stats.device_hit_pages += len(pages) - below
        self.stats.host_hit_pages += below - from_disk
        self.stats.disk_hit_pages += from_disk

    def _below(self, key: HostKey) -> bool:
        """Does a tier below the device hold the prefix page ``key`` (the host tier, else the disk)?"""
        return self.host.holds(key) or (self.disk is not None and self.disk.holds(key))

    def _load_from_disk(self, promoted: dict[str, list[tuple[int, HostSource]]]) -> dict[HostKey, HostPage] | None:
        """The pages of ``promoted`` the host tier lacks, read from disk (before any host page is
        taken, so that a miss changes nothing); None when one is gone from disk since the lookup."""
        wanted = [source.key for found in promoted.values() for _, source in found if not self.host.holds(source.key)]
        if not wanted:
            return {}
        loaded = {key: self.disk.load(key) for key in wanted}
        return None if None in loaded.values() else loaded

    def _persist(self, pool: PagePool, page: int, key: HostKey) -> None:
        """Queue a read of the newly registered ``page`` for the disk tier, unless it is there already."""
        if self.disk is None or self.disk.holds(key):
            return
        host_page = HostPage(pool.page_bytes)
        self._moves.out.setdefault(pool.name, []).append((page, host_page))
        self._moves.persist.append((key, host_page))

    def _resume_hit(self, seq: SequenceState, swapped: Swapped) -> PrefixHit | None:
        """The pages a swapped-out sequence resumes from: its registered pages found by hash (any
        tier), then its swapped pages; None when some registered page is gone from every tier."""
        pages = {}
        for pool in self.pools:
            first = min(pool.first_needed_page(swapped.num_tokens), swapped.num_registered)
            prefix = pool.cached_pages(seq.page_hashes, first, swapped.num_registered, self._below)
            if prefix is None:
                return None
            pages[pool.name] = [NULL_PAGE] * first + prefix + swapped.pages[pool.name]
        return PrefixHit(pages, swapped.num_tokens, resumes=True)

    def _swap_pages(self, pool: PagePool, seq: SequenceState, tail: list[int], start: int) -> list[PageSource]:
        """Pin a host copy of each page of ``tail`` (``seq``'s pages from logical page ``start`` on;
        ``NULL_PAGE`` stays) and queue its read."""
        sources: list[PageSource] = []
        for logical, page in enumerate(tail, start=start):
            if page == NULL_PAGE:
                sources.append(NULL_PAGE)
                continue
            key, host_page = swap_key(pool.name, seq.key, logical), HostPage(pool.page_bytes)
            self.host.demote(key, host_page, pinned=True)
            self._moves.out.setdefault(pool.name, []).append((page, host_page))
            sources.append(HostSource(key, None))
        return sources

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
        """Before ``n`` pages are taken from ``pool``: demote the cached pages that evicts to the host
        tier (read before the next step; dropped when the tier is off or full of pinned pages)."""
        for page, page_hash in pool.manager.evictions(n):
            host_page = HostPage(pool.page_bytes)
            if self.host.demote(prefix_key(pool.name, page_hash), host_page):
                self._moves.out.setdefault(pool.name, []).append((page, host_page))

    def _free_device(self, seq: SequenceState) -> None:
        for pool in self.pools:
            pool.manager.free(seq.key)
        seq.num_registered = 0

    def _forget_swap(self, seq: SequenceState) -> None:
        swapped = self.swapped.pop(seq.key, None)
        for sources in () if swapped is None else swapped.pages.values():
            for page in sources:
                if isinstance(page, HostSource):
                    self.host.discard(page.key)

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
        """Raise ``AssertionError`` naming the first broken invariant over both tiers: each ledger's,
        no hash both in a device pool and in the host tier, pinned host pages exactly the swapped
        sequences' pages (which hold no device page); under a page budget, no sequence over it and
        no compacted sequence's page in the prefix cache. O(pools + host tier)."""
        for pool in self.pools:
            pool.manager.check()
        self.host.check()
        swapped = {page.key for s in self.swapped.values() for p in s.pages.values() for page in p if page != NULL_PAGE}
        for key in self.host.stored_keys():
            if key in swapped:
                continue
            pool, page_hash = key
            if self._pool(pool).manager.cached(page_hash) is not None:
                raise AssertionError(f"page hash {page_hash.hex()} of the {pool} pool is in both tiers")
            if self.host.pinned(key):
                raise AssertionError(f"prefix page {key!r} is pinned in the host tier")
        missing = [key for key in swapped if not self.host.pinned(key)]
        if missing:
            raise AssertionError(f"swapped pages {missing} are not pinned in the host tier")
        holding = [owner for owner in self.swapped if any(pool.manager.pages(owner) for pool in self.pools)]
        if holding:
            raise AssertionError(f"swapped-out owners {holding} still hold device pages")
        if self.budget is not None:
            self._check_budget()

    def _check_budget(self) -> None:
        """Every owner within its full-pool budget (a compacted one) or what a compaction reads (a
        prompt prefilled whole); no compacted owner's page registered."""
        manager = self._pool(FULL_POOL).manager
        most = {
            owner: self.budget.max_pages if owner in self.compacted else self.budget.source_pages
            for owner in manager.owners()
        }
        over = [owner for owner in manager.owners() if len(manager.pages(owner)) > most[owner]]
        if over:
            raise AssertionError(
                f"owners {over} hold more pages than their budget (max_pages_per_request={self.budget.max_pages})"
            )
        cached = [owner for owner in self.compacted if any(manager.page_hash(p) for p in manager.pages(owner))]
        if cached:
            raise AssertionError(f"compacted owners {cached} hold pages registered in the prefix cache")

    # --- what the model runner and the metrics read ---------------------------------------------------
    def table_widths(self, max_model_len: int) -> dict[str, int]:
        """Block-table columns per pool name for sequences of up to ``max_model_len`` tokens: a
        budgeted full pool's rows hold at most what a compaction reads."""
        widths = {}
        for pool in self.pools:
            length = max_model_len
            if pool.window is None and self.budget is not None:
                length = min(max_model_len, self.budget.source_pages * pool.page_size)
            widths[pool.name] = table_width(length, pool.page_size)
        return widths

    def pages(self, pool: str, seq: SequenceState) -> list[int]:
        """``seq``'s pages in the pool named ``pool`` by logical page (``NULL_PAGE`` where a window
        left one; none for a sequence without pages)."""
        return self._pool(pool).manager.pages(seq.key)

    def shift(self, seq: SequenceState) -> int:
        """How far the positions of ``seq``'s new tokens run ahead of their full-pool slots (its
        row's entry of ``PackedBatch.shifts`` under a page budget)."""
        return self.compacted.get(seq.key, 0)

    def block_tables(
        self, running: Sequence[SequenceState], num_rows: int, max_model_len: int
    ) -> dict[str, np.ndarray]:
        """Per pool name ``[R, W]`` int32: each running sequence's pages in its row, the null page
        elsewhere, rebuilt whole: the oracle of the model runner's block tables, which the step
        plans change row by row (``jaxkv.serving.plan``)."""
        tables = {}
        for pool in self.pools:
            table = np.full((num_rows, self.table_widths(max_model_len)[pool.name]), NULL_PAGE, np.int32)
            for seq in running:
                pages = pool.manager.pages(seq.key)
                table[seq.row, : len(pages)] = pages
            tables[pool.name] = table
        return tables

    def row_shifts(self, running: Sequence[SequenceState], num_rows: int) -> dict[str, np.ndarray]:
        """``PackedBatch.shifts``: ``[R]`` each running row's shift in the full pool under a budget
        (0 for the other rows); empty without one. Rebuilt whole: the oracle of the model runner's
        shifts, like ``block_tables``."""
        if self.budget is None or not self.pools or self.pools[0].window is not None:
            return {}
        shifts = np.zeros(num_rows, np.int32)
        for seq in running:
            shifts[seq.row] = self.shift(seq)
        return {FULL_POOL: shifts}

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
