"""KV-cache management: the page pools' ledgers and the prefix cache, behind the few questions
the scheduler asks (vLLM's ``KVCacheManager``).

Each pool (the full-attention layers; the sliding-window layers) has its own ``PageManager``
and block table. The scheduler never touches a page: it asks for room for a sequence's next
tokens (``allocate``, with the prefix the cache holds for a new sequence from ``lookup``), for a
fork of a computed prompt (``fork``), and hands back what finished (``free``); each answer is
one ``Allocation``, or None when there is no room (and then nothing changed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxkv.layers.paged import NULL_PAGE, pool_name, table_width
from jaxkv.serving.pages import PageManager, PoolExhausted, page_hashes
from jaxkv.serving.requests import RequestError, SequenceState
from jaxkv.serving.sizing import PoolSizes


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

    def cached_pages(self, hashes: list[bytes], num_pages: int) -> list[int] | None:
        """This pool's cached pages that let a sequence resume at page ``num_pages`` of the chain
        ``hashes`` (NULL_PAGE for pages a window no longer reads), or None if some are gone."""
        first = self.first_needed_page(num_pages * self.page_size)
        found = self.manager.lookup(hashes[first:num_pages])
        if len(found) != num_pages - first:
            return None
        return [NULL_PAGE] * first + found


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """The longest prefix of a sequence the prefix cache holds in every pool: ``pages`` per pool
    name (empty: none), ``num_tokens`` tokens of it."""

    pages: dict[str, list[int]]
    num_tokens: int


NO_HIT = PrefixHit({}, 0)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The KV manager's one answer to the scheduler: ``num_new_pages`` pages given per pool name,
    ``num_cached_tokens`` tokens the prefix cache already held (an admission), and the page
    ``copies`` ``(source, destination)`` per pool name the next step performs before it writes
    (a fork's copy-on-write)."""

    num_new_pages: dict[str, int]
    num_cached_tokens: int = 0
    copies: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Usage:
    """Pages in use now over every pool, and their bytes."""

    pages: int
    bytes: int


class KVCacheManager:
    """The page pools of one engine and its prefix cache (``prefix_caching``: full pages are
    registered by the hash chain of their tokens and shared by later sequences)."""

    def __init__(self, sizes: PoolSizes, prefix_caching: bool):
        self.pools: list[PagePool] = []
        if sizes.full_pages:
            self.pools.append(PagePool(PageManager(sizes.full_pages, sizes.page_size), None, sizes.full_page_bytes))
        if sizes.sliding_pages:
            manager = PageManager(sizes.sliding_pages, sizes.page_size)
            self.pools.append(PagePool(manager, sizes.window, sizes.sliding_page_bytes))
        self.page_size = sizes.page_size
        self.prefix_caching = prefix_caching

    # --- what a request needs, checked when it arrives -----------------------------------------------
    def check_fits(self, num_prompt: int, num_tokens: int, n: int, chunk_tokens: int) -> None:
        """Refuse a request the pools could never hold, even alone: ``n`` sequences of
        ``num_tokens`` tokens (they share the prompt's full pages), each step writing up to
        ``chunk_tokens`` tokens of it."""
        for pool in self.pools:
            pages = -(-num_tokens // pool.page_size)
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
        """The longest chain of ``seq``'s full pages that every pool still holds, leaving at least
        its last token to compute (its logits draw the next). Changes nothing."""
        if not self.prefix_caching:
            return NO_HIT
        num_pages = (seq.num_tokens - 1) // self.page_size
        hashes = self._chain(seq, num_pages)
        while num_pages:
            found = [pool.cached_pages(hashes, num_pages) for pool in self.pools]
            if all(pages is not None for pages in found):
                return PrefixHit(
                    {pool.name: pages for pool, pages in zip(self.pools, found)}, num_pages * self.page_size
                )
            num_pages -= 1
        return NO_HIT

    def allocate(self, seq: SequenceState, num_new_tokens: int, hit: PrefixHit | None = None) -> Allocation | None:
        """Room for ``seq``'s next ``num_new_tokens`` tokens in every pool, after the tokens it has
        computed (or, for a sequence being admitted, after the prefix ``hit``, whose pages it now
        shares). None, and nothing changed, when a pool is short of pages."""
        if hit is not None:
            for name, pages in hit.pages.items():  # empty without a hit
                self._pool(name).manager.share(seq.key, pages)
            seq.num_registered = hit.num_tokens // self.page_size
        start = seq.num_computed if hit is None else hit.num_tokens
        for pool in self.pools:  # pages a window has left go first: they may be what the others need
            pool.manager.drop_leading(seq.key, pool.first_needed_page(start))
        needed = {pool.name: pool.pages_needed(seq, start + num_new_tokens) for pool in self.pools}
        if not all(pool.manager.can_allocate(needed[pool.name]) for pool in self.pools):
            if hit is not None:
                self.free(seq)
            return None
        for pool in self.pools:
            if needed[pool.name]:
                pool.manager.allocate(seq.key, needed[pool.name])
        return Allocation(needed, 0 if hit is None else hit.num_tokens)

    def fork(self, parent: SequenceState, child: SequenceState) -> Allocation | None:
        """``child`` starts on ``parent``'s computed prompt: it shares the full pages of all but the
        prompt's last token and gets a copy of the page that token sits in (copy-on-write; it
        recomputes that token to draw its own first one). None, and nothing changed, when a pool
        has no page for the copy."""
        shared = len(child.prompt) - 1
        copies = {}
        for done, pool in enumerate(self.pools):
            try:
                copies[pool.name] = pool.manager.fork(parent.key, child.key, shared)
            except PoolExhausted:
                for undo in self.pools[:done]:
                    undo.manager.free(child.key)
                return None
        child.page_hashes = list(parent.page_hashes[: shared // self.page_size])
        child.num_registered = min(parent.num_registered, shared // self.page_size)
        return Allocation({pool.name: len(copies[pool.name]) for pool in self.pools}, copies=copies)

    def computed(self, seq: SequenceState) -> None:
        """``seq``'s computed tokens grew: offer its newly full pages to the prefix cache."""
        if not self.prefix_caching:
            return
        full = seq.num_computed // self.page_size
        hashes = self._chain(seq, full)
        for pool in self.pools:
            pages = pool.manager.pages(seq.key)
            for logical in range(seq.num_registered, full):
                if pages[logical] != NULL_PAGE:
                    pool.manager.register(pages[logical], hashes[logical])
        seq.num_registered = full

    def free(self, seq: SequenceState) -> None:
        """Release every page of ``seq`` (tail first); cached pages stay findable until reused."""
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
            seq.page_hashes += page_hashes(tokens, self.page_size, seq.options.cache_salt, parent)
        return seq.page_hashes[:num_pages]

    # --- what the model runner and the metrics read ---------------------------------------------------
    def block_tables(
        self, running: Sequence[SequenceState], num_rows: int, max_model_len: int
    ) -> dict[str, np.ndarray]:
        """Per pool name ``[R, W]`` int32: each running sequence's pages in its row, the null page elsewhere."""
        tables = {}
        for pool in self.pools:
            table = np.full((num_rows, table_width(max_model_len, pool.page_size)), NULL_PAGE, np.int32)
            for seq in running:
                pages = pool.manager.pages(seq.key)
                table[seq.row, : len(pages)] = pages
            tables[pool.name] = table
        return tables

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
            unused += max(slots - seq.num_computed, 0)
        return allocated, unused
