"""Continuous batching on the host: which tokens of which requests the next step computes.

vLLM's rule: every running sample's computed tokens catch up with its known tokens (the
prompt, then each sampled token). Running samples go first, oldest first: a decode brings
one token (every running row has a decode slot in each step), a prompt brings a chunk of
what the step's prefill budget leaves (chunked prefill; a chunk costs whole blocks of
``QUERY_BLOCK`` tokens, the unit paged attention reads); then waiting samples are admitted
while rows, budget and pages last. A sample that needs a page when the pool is full preempts the newest running sample
(its pages are freed and it is computed again later, so nothing is dropped); with prefix
caching the pages it filled stay cached and usually make its recomputation a cache hit.

Each pool (full attention; sliding windows) has its own page manager and block table; a
sliding pool frees the pages that left the window before it allocates.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxkv.layers.paged import QUERY_BLOCK
from jaxkv.serving.pages import NULL_PAGE, PageManager, page_hashes
from jaxkv.serving.requests import SampleState, Status


@dataclasses.dataclass
class Pool:
    """The pages of the layers that share one block table: all full-attention layers, or all
    sliding-window layers (``window``)."""

    name: str
    manager: PageManager
    window: int | None
    page_bytes: int  # bytes one page holds over every layer of the pool (K and V)

    @property
    def page_size(self) -> int:
        return self.manager.page_size

    def first_needed_page(self, position: int) -> int:
        """The first logical page a query at ``position`` reads."""
        return 0 if self.window is None else max(0, position - self.window + 1) // self.page_size

    def cached_pages(self, hashes: list[bytes], num_pages: int) -> list[int] | None:
        """This pool's cached pages that let a sample resume at page ``num_pages`` of the chain
        ``hashes`` (NULL_PAGE for pages a window no longer reads), or None if some are gone."""
        first = self.first_needed_page(num_pages * self.page_size)
        found = self.manager.lookup(hashes[first:num_pages])
        if len(found) != num_pages - first:
            return None
        return [NULL_PAGE] * first + found


@dataclasses.dataclass(frozen=True)
class Chunk:
    """``count`` tokens of ``sample`` from position ``start`` on, computed this step."""

    sample: SampleState
    start: int
    count: int

    @property
    def samples_next(self) -> bool:
        """Does this chunk compute the sample's last known token (so a token is drawn)?"""
        return self.start + self.count == self.sample.num_tokens


def chunk_length(sample: SampleState, budget: int) -> int:
    """Tokens ``sample`` computes next: its one missing token (a decode: no budget), else as
    many of its missing tokens as ``budget`` holds."""
    missing = sample.num_tokens - sample.num_computed
    return missing if missing <= 1 else min(missing, budget)


def chunk_cost(count: int) -> int:
    """Prefill budget a chunk takes: none for a decode, else whole query blocks."""
    return 0 if count == 1 else -(-count // QUERY_BLOCK) * QUERY_BLOCK


@dataclasses.dataclass
class SchedulerStats:
    preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0


class Scheduler:
    """Rows, pages and the order of work; the engine runs what ``schedule`` returns and reports
    back with ``computed``."""

    def __init__(self, pools: list[Pool], max_rows: int, token_budget: int, prefix_caching: bool):
        self.pools = pools
        self.token_budget = token_budget
        self.prefix_caching = prefix_caching
        self.waiting: collections.deque[SampleState] = collections.deque()
        self.running: list[SampleState] = []
        self.free_rows = list(range(max_rows))
        self.stats = SchedulerStats()

    @property
    def page_size(self) -> int:
        return self.pools[0].page_size

    # --- the step's work ------------------------------------------------------------------
    def schedule(self) -> list[Chunk]:
        """This step's chunks, running samples first, then admissions; prefill chunks within
        ``token_budget`` tokens (counted in whole query blocks)."""
        budget, chunks = self.token_budget, []
        for sample in list(self.running):
            if sample.status is not Status.RUNNING:  # preempted for an older sample this step
                continue
            count = chunk_length(sample, budget)
            if count and self.reserve_or_preempt(sample, count):
                chunks.append(Chunk(sample, sample.num_computed, count))
                budget -= chunk_cost(count)
        while self.waiting and self.free_rows and budget:
            chunk = self.admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            chunks.append(chunk)
            budget -= chunk_cost(chunk.count)
        return chunks

    def reserve_or_preempt(self, sample: SampleState, count: int) -> bool:
        """Pages for ``count`` more tokens of a running sample, preempting the newest running
        samples until they fit; False if ``sample`` itself had to be preempted."""
        while not self.reserve(sample, count):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is sample:
                return False
        return True

    def reserve(self, sample: SampleState, count: int) -> bool:
        """Give ``sample`` the pages its next ``count`` tokens write, in every pool, or change nothing."""
        end = sample.num_computed + count
        for pool in self.pools:  # pages a window has left go first: they may be what the others need
            pool.manager.drop_leading(sample.key, pool.first_needed_page(sample.num_computed))
        needed = [-(-end // pool.page_size) - len(pool.manager.pages(sample.key)) for pool in self.pools]
        if not all(pool.manager.can_allocate(max(n, 0)) for pool, n in zip(self.pools, needed)):
            return False
        for pool, n in zip(self.pools, needed):
            if n > 0:
                pool.manager.allocate(sample.key, n)
        return True

    def admit(self, sample: SampleState, budget: int) -> Chunk | None:
        """Start (or resume) a waiting sample: reuse its longest cached prefix, give it a row and
        the pages of its first chunk. None (and nothing changed) when its pages do not fit."""
        if self.prefix_caching:
            self.reuse_prefix(sample)
        count = chunk_length(sample, budget)
        if not count or not self.reserve(sample, count):
            self.release(sample)
            return None
        sample.status, sample.row = Status.RUNNING, self.free_rows.pop(0)
        self.running.append(sample)
        if self.prefix_caching:
            self.stats.prefix_queried_tokens += sample.num_tokens
            self.stats.prefix_hit_tokens += sample.num_computed
        return Chunk(sample, sample.num_computed, count)

    def reuse_prefix(self, sample: SampleState) -> None:
        """Share the cached pages of the longest chain of ``sample``'s full pages that every pool
        still holds, leaving at least its last token to compute (its logits draw the next)."""
        num_pages = (sample.num_tokens - 1) // self.page_size
        hashes = self.chain(sample, num_pages)
        while num_pages:
            found = [pool.cached_pages(hashes, num_pages) for pool in self.pools]
            if all(pages is not None for pages in found):
                for pool, pages in zip(self.pools, found):
                    pool.manager.share(sample.key, pages)
                break
            num_pages -= 1
        sample.num_computed = sample.num_cached_tokens = num_pages * self.page_size
        sample.num_registered = num_pages

    def chain(self, sample: SampleState, num_pages: int) -> list[bytes]:
        """The hash chain of ``sample``'s first ``num_pages`` full pages (extended as it grows)."""
        have = len(sample.page_hashes)
        if num_pages > have:
            size = self.page_size
            parent = sample.page_hashes[-1] if have else None
            tokens = sample.tokens[have * size : num_pages * size]
            sample.page_hashes += page_hashes(tokens, size, sample.options.cache_salt, parent)
        return sample.page_hashes[:num_pages]

    # --- after the step -------------------------------------------------------------------
    def computed(self, chunks: list[Chunk]) -> None:
        """The step ran: advance each chunk's sample and offer its newly full pages to the prefix cache."""
        for chunk in chunks:
            chunk.sample.num_computed = chunk.start + chunk.count
            if self.prefix_caching:
                self.register_full_pages(chunk.sample)

    def register_full_pages(self, sample: SampleState) -> None:
        full = sample.num_computed // self.page_size
        hashes = self.chain(sample, full)
        for pool in self.pools:
            pages = pool.manager.pages(sample.key)
            for logical in range(sample.num_registered, full):
                if pages[logical] != NULL_PAGE:
                    pool.manager.register(pages[logical], hashes[logical])
        sample.num_registered = full

    # --- leaving ----------------------------------------------------------------------------
    def release(self, sample: SampleState) -> None:
        """Free ``sample``'s pages (tail first) and its row; it keeps its tokens."""
        for pool in self.pools:
            pool.manager.free(sample.key)
        if sample.row is not None:
            self.free_rows.append(sample.row)
            sample.row = None
        if sample in self.running:
            self.running.remove(sample)
        sample.num_computed = sample.num_registered = 0

    def preempt(self, sample: SampleState) -> None:
        """Free a running sample's pages; it waits at the front and is computed again."""
        self.release(sample)
        sample.status = Status.WAITING
        self.waiting.appendleft(sample)
        self.stats.preemptions += 1

    def finish(self, sample: SampleState) -> None:
        """Free a sample that has finished or was aborted, wherever it is."""
        self.release(sample)
        if sample in self.waiting:
            self.waiting.remove(sample)
        sample.status = Status.FINISHED

    # --- n > 1: samples that share their prompt's pages -----------------------------------------
    def fork(self, parent: SampleState, child: SampleState) -> list[list[tuple[int, int]]] | None:
        """Start ``child`` on ``parent``'s computed prompt: it shares the full pages of all but the
        prompt's last token and gets a copy of the page that token sits in (copy-on-write); it
        recomputes that token to draw its own first one. Returns each pool's page copies, or
        None (nothing changed) when there is no row or page for it."""
        if not self.free_rows:
            return None
        shared = len(child.prompt) - 1
        copies = []
        for done, pool in enumerate(self.pools):
            try:
                copies.append(pool.manager.fork(parent.key, child.key, shared))
            except RuntimeError:
                for undo in self.pools[:done]:
                    undo.manager.free(child.key)
                return None
        child.num_computed = shared
        child.page_hashes = list(parent.page_hashes[: shared // self.page_size])
        child.num_registered = min(parent.num_registered, shared // self.page_size)
        child.status, child.row = Status.RUNNING, self.free_rows.pop(0)
        self.running.append(child)
        return copies

    # --- what the engine reads --------------------------------------------------------------------
    def wasted_slots(self) -> tuple[int, int]:
        """``(allocated, unused)`` slots of the running samples' pages in the first pool (the full-attention
        pool when the model has one); none when nothing is paged (every layer evicted)."""
        if not self.pools:
            return 0, 0
        pool = self.pools[0]
        allocated = unused = 0
        for sample in self.running:
            slots = sum(page != NULL_PAGE for page in pool.manager.pages(sample.key)) * pool.page_size
            allocated += slots
            unused += max(slots - sample.num_computed, 0)
        return allocated, unused
