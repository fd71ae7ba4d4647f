"""Host-side bookkeeping of the paged K/V pool: who holds which page, and which pages hold a cached prefix.

The serving engine keeps K/V in one pool of fixed-size pages shared by every request (vLLM's design).
The device arrays hold the pages; this module is the plain-Python ledger that runs outside jit:

* each owner (a request) has a list of pages indexed by logical page (page ``i`` holds its tokens
  ``[i * page_size, (i + 1) * page_size)``);
* each page has a reference count: several owners hold the same page when they share a prefix (prefix
  cache hits, forked samples). A shared page is always full, so nobody writes it again;
* pages at refcount 0 wait in the free queue, least recently freed first. The queue is also the LRU order of
  the automatic prefix cache: a free page keeps its hash (and its K/V on device) until ``allocate`` hands it
  out again, so a later request with the same prefix can take it back with ``share``;
* a full page is keyed by a hash chained over every token before it (``page_hashes``), so equal hashes mean
  equal prefixes, hence equal K/V;
* ``evictions`` tells, before an allocation, which cached pages it will evict, so the engine can demote
  them to its host tier (``jaxkv.serving.host_tier``) instead of losing them; ``allocate_at`` gives fresh
  pages to logical pages whose contents come back from there.

Page 0 (``NULL_PAGE``) is never handed out: padding writes land there and block-table entries that hold
nothing point there. Every operation costs O(pages touched); only ``check`` walks the whole pool.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from jaxkv.layers.paged import NULL_PAGE

HASH_BYTES = 16

Owner = Hashable


class PoolExhausted(RuntimeError):
    """Not enough free pages for an allocation; the pool is left as it was."""


def page_hashes(tokens: Sequence[int], page_size: int, extra: bytes = b"", parent: bytes | None = None) -> list[bytes]:
    """Hash chain over the full pages of ``tokens`` (a trailing partial page gets no hash).

    ``h_i = blake2b(h_{i-1} + tokens of page i as int64 little-endian + extra)``, with ``b""`` in place of
    ``h_{-1}``: each hash covers every token before the end of its page, so two pages share a hash only when
    their whole prefixes agree. ``parent`` is the hash of the page before ``tokens[0]`` (extending a chain;
    ``tokens`` then starts at a page boundary). ``extra`` separates chains that must never share pages (a
    tenant's ``salt_key``). blake2b, not Python's ``hash``: the keys agree across processes and runs.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    num_full = len(tokens) // page_size
    pages = np.asarray(tokens[: num_full * page_size], dtype="<i8").reshape(num_full, page_size)
    chain = []
    previous = b"" if parent is None else parent
    for page in pages:
        previous = hashlib.blake2b(previous + page.tobytes() + extra, digest_size=HASH_BYTES).digest()
        chain.append(previous)
    return chain


def salt_key(cache_salt: str | None) -> bytes:
    """The ``extra`` bytes of a request's hash chain: ``b""`` without a salt, else the salt's utf-8 bytes
    behind their length (4 bytes little-endian), so no salt is a prefix of another's encoding."""
    if cache_salt is None:
        return b""
    encoded = cache_salt.encode("utf-8")
    return len(encoded).to_bytes(4, "little") + encoded


class PageManager:
    """Reference counts, per-owner page lists, the free queue (LRU of the prefix cache) and the hash index.

    Usable pages are ``1 .. num_pages - 1``. Owners are any hashable (the engine uses request ids).
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(
                f"num_pages must be at least 2 (page {NULL_PAGE} is reserved for padding), got {num_pages}: "
                "give the pool more kv_memory or use smaller pages"
            )
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refcounts = [0] * num_pages
        self._num_used = 0
        # Front: least recently freed, handed out (and evicted from the prefix cache) first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self._lists: dict[Owner, list[int]] = {}
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages at refcount 0, cached or not: what ``allocate`` can hand out."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Pages holding a registered hash, in use or free."""
        return len(self._hash_of_page)

    def refcount(self, page: int) -> int:
        self._check_in_pool(page, "read the refcount of")
        return self._refcounts[page]

    def pages(self, owner: Owner) -> list[int]:
        """The owner's pages by logical index (``NULL_PAGE`` where dropped); ``[]`` for an unknown owner."""
        return list(self._lists.get(owner, ()))

    def owners(self) -> list[Owner]:
        return list(self._lists)

    def page_hash(self, page: int) -> bytes | None:
        return self._hash_of_page.get(page)

    def usage(self) -> dict[str, int]:
        return {"used": self.num_used, "free": self.num_free, "cached": self.num_cached, "usable": self.num_usable}

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, owner: Owner, n: int) -> list[int]:
        """Append ``n`` fresh pages to the owner's list (creating it) and return them.

        Pages come from the front of the free queue; one that held a cached prefix is evicted (loses its
        hash). Raises ``PoolExhausted``, changing nothing, when fewer than ``n`` pages are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        self._require_free(n)
        fresh = [self._take_free() for _ in range(n)]
        self._lists.setdefault(owner, []).extend(fresh)
        return fresh

    def allocate_at(self, owner: Owner, indices: Sequence[int]) -> list[int]:
        """Put fresh pages at the owner's ``NULL_PAGE`` placeholders ``indices`` (logical pages whose
        contents come from elsewhere: the host tier) and return them. Raises ``PoolExhausted``, changing
        nothing, when too few pages are free."""
        owned = self._lists.get(owner, [])
        taken = [index for index in indices if not 0 <= index < len(owned) or owned[index] != NULL_PAGE]
        if taken:
            raise ValueError(f"allocate_at: logical pages {taken} of {owner!r} are not NULL_PAGE placeholders")
        self._require_free(len(indices))
        fresh = [self._take_free() for _ in indices]
        for index, page in zip(indices, fresh):
            owned[index] = page
        return fresh

    def evictions(self, n: int) -> list[tuple[int, bytes]]:
        """``(page, hash)`` of the cached pages the next allocation of ``n`` pages evicts (the front of the
        free queue); changes nothing. The engine demotes them to the host tier before they are written."""
        front = itertools.islice(self._free, min(n, len(self._free)))
        return [(page, self._hash_of_page[page]) for page in front if page in self._hash_of_page]

    def cached(self, page_hash: bytes) -> int | None:
        """The page cached under ``page_hash`` (in use or free), or None."""
        return self._page_of_hash.get(page_hash)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest prefix of ``hashes`` that are all cached (in use or free); changes nothing."""
        found = []
        for page_hash in hashes:
            page = self.cached(page_hash)
            if page is None:
                break
            found.append(page)
        return found

    def share(self, owner: Owner, pages: Sequence[int]) -> None:
        """Append ``pages`` (cached pages from ``lookup``, or another owner's pages) to the owner's list.

        Each gains a reference; a free one leaves the free queue, so it can no longer be evicted. A
        ``NULL_PAGE`` entry is a placeholder, not a reference: a sliding-window owner resuming from the cache
        starts with the leading pages its window no longer reads already dropped."""
        held = [page for page in pages if page != NULL_PAGE]
        for page in held:
            self._check_in_pool(page, "share")
            if self._refcounts[page] == 0 and page not in self._hash_of_page:
                raise ValueError(
                    f"page {page} is free and holds no cached prefix, so its contents are gone: share only pages "
                    "that lookup returned or that a live owner holds"
                )
        self._acquire(held)
        self._lists.setdefault(owner, []).extend(pages)

    def register(self, page: int, page_hash: bytes) -> bool:
        """Mark a full, in-use page as cached under ``page_hash``; True if it now is.

        No-op (False) when the page already has a hash, or when another page is cached under it (the first
        copy stays canonical; the duplicate is released uncached)."""
        self._check_page(page, "register")
        if self._refcounts[page] == 0:
            raise ValueError(
                f"page {page} is free: register a page while its owner holds it (right after its last token is written)"
            )
        if page in self._hash_of_page or page_hash in self._page_of_hash:
            return False
        self._hash_of_page[page] = page_hash
        self._page_of_hash[page_hash] = page
        return True

    def fork(self, parent: Owner, child: Owner, num_tokens: int) -> list[tuple[int, int]]:
        """Copy-on-write fork: ``child`` gets the parent's first ``num_tokens`` tokens.

        The child shares the parent's full pages among them (and keeps ``NULL_PAGE`` where the parent dropped
        one); a partial last page is not shareable (both would write it), so the child gets a fresh page and
        the result lists the ``(source, destination)`` page copies the engine must make on device before the
        child writes. Raises ``PoolExhausted``, changing nothing, when that page cannot be allocated."""
        parent_pages = self._fork_source(parent, child, num_tokens)
        num_full, partial = divmod(num_tokens, self.page_size)
        self._require_free(1 if partial else 0)
        shared = parent_pages[:num_full]
        self.share(child, shared)
        if not partial:
            return []
        return [(parent_pages[num_full], self.allocate(child, 1)[0])]

    def compaction_fresh_pages(self, owner: Owner, num_pages: int, first_uncached: int = 0) -> int:
        """Fresh pages ``compact(owner, num_pages, first_uncached)`` takes (what its reusable pages do
        not cover)."""
        return max(num_pages - len(self._reusable(owner, first_uncached)), 0)

    def compact(self, owner: Owner, num_pages: int, first_uncached: int = 0) -> tuple[list[int], list[int]]:
        """Give the owner ``num_pages`` pages to compact its tokens into; returns its pages before
        (the compaction's sources) and after (its destinations, now its whole list).

        A destination is one of its pages that nobody else holds (reused in place, in logical order),
        else a fresh page; its other pages are released (a shared page keeps its other owners, a
        cached one stays findable): a page others may read is never written. A page the prefix cache
        holds is reused, leaving the cache, only from logical page ``first_uncached`` on (the engine
        keeps a prompt's pages cached and lets its outputs' go: copying every cached page first would
        need ``num_pages`` free pages at once). Raises ``PoolExhausted``, changing nothing, when too
        few pages are free."""
        if num_pages < 1:
            raise ValueError(f"compact: num_pages must be at least 1, got {num_pages}")
        sources = self.pages(owner)
        reused = self._reusable(owner, first_uncached)[:num_pages]
        self._require_free(num_pages - len(reused))
        for page in reused:
            self._uncache(page)
        fresh = [self._take_free() for _ in range(num_pages - len(reused))]
        for page in reversed(sources):  # tail first, as in free
            if page not in reused:
                self._release(page)
        self._lists[owner] = reused + fresh
        return sources, reused + fresh

    def _reusable(self, owner: Owner, first_uncached: int) -> list[int]:
        """The owner's pages only it holds, in logical order, less the cached ones before logical page
        ``first_uncached``."""
        return [
            page for index, page in enumerate(self._lists.get(owner, ()))
            if page != NULL_PAGE and self._refcounts[page] == 1
            and (index >= first_uncached or page not in self._hash_of_page)
        ]  # fmt: skip

    def drop_leading(self, owner: Owner, num_logical_pages: int) -> None:
        """Release the owner's pages at logical indices below ``num_logical_pages`` (they left a sliding
        window), leaving ``NULL_PAGE`` in their place so later indices keep their meaning. Idempotent."""
        owned = self._lists.get(owner, [])
        leading = range(min(num_logical_pages, len(owned)) - 1, -1, -1)  # tail first, as in free
        for index in leading:
            self._release(owned[index])
            owned[index] = NULL_PAGE

    def free(self, owner: Owner) -> None:
        """Release every page of the owner and forget it; an unknown (or already freed) owner is a no-op.

        Tail first: a request's later pages return to the free queue before its head, so the head of its
        chain, the part other requests are likeliest to share, is evicted last."""
        for page in reversed(self._lists.pop(owner, [])):
            self._release(page)

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant of the ledger. O(pool)."""
        held = Counter(page for owned in self._lists.values() for page in owned if page != NULL_PAGE)
        negative = {page: count for page, count in enumerate(self._refcounts) if count < 0}
        mismatched = {page: (held[page], count) for page, count in enumerate(self._refcounts) if held[page] != count}
        expected_free = [page for page in range(1, self.num_pages) if self._refcounts[page] == 0]
        in_use = self.num_usable - len(expected_free)
        _require(not negative, f"negative refcounts {negative}")
        _require(not mismatched, f"{{page: (times held by owners, refcount)}} disagree: {mismatched}")
        _require(
            sorted(self._free) == expected_free,
            f"free queue {sorted(self._free)} is not the refcount-0 usable pages {expected_free}",
        )
        _require(self._num_used == in_use, f"num_used is {self._num_used}, {in_use} pages have a refcount")
        _require(self.num_free + self.num_used == self.num_usable, f"free + used != usable: {self.usage()}")
        _require(
            len(self._page_of_hash) == len(self._hash_of_page)
            and all(self._page_of_hash.get(h) == page for page, h in self._hash_of_page.items()),
            "the hash -> page and page -> hash maps are not inverse",
        )
        _require(NULL_PAGE not in self._hash_of_page, "NULL_PAGE is registered in the prefix cache")

    def _take_free(self) -> int:
        """Pop the least recently freed page, evicting its cached prefix; it enters use at refcount 1."""
        page, _ = self._free.popitem(last=False)
        self._uncache(page)
        self._refcounts[page] = 1
        self._num_used += 1
        return page

    def _uncache(self, page: int) -> None:
        """Drop ``page``'s cached prefix, if it holds one (its contents are about to change)."""
        evicted = self._hash_of_page.pop(page, None)
        if evicted is not None:
            del self._page_of_hash[evicted]

    def _acquire(self, pages: Iterable[int]) -> None:
        """One more reference to each page; a free (cached) one leaves the free queue."""
        for page in pages:
            if self._refcounts[page] == 0:
                del self._free[page]
                self._num_used += 1
            self._refcounts[page] += 1

    def _release(self, page: int) -> None:
        """One reference less; at 0 the page goes to the back of the free queue, keeping its cached prefix.
        ``NULL_PAGE`` (a dropped entry) holds no reference."""
        if page == NULL_PAGE:
            return
        self._refcounts[page] -= 1
        if self._refcounts[page] == 0:
            self._free[page] = None
            self._num_used -= 1

    def _require_free(self, n: int) -> None:
        if not self.can_allocate(n):
            raise PoolExhausted(
                f"asked for {n} pages, {self.num_free} of {self.num_usable} free: "
                "give the pool more kv_memory or admit fewer concurrent requests"
            )

    def _check_page(self, page: int, action: str) -> None:
        if page == NULL_PAGE:
            raise ValueError(f"cannot {action} NULL_PAGE: page {NULL_PAGE} is reserved for padding writes")
        self._check_in_pool(page, action)

    def _check_in_pool(self, page: int, action: str) -> None:
        if not 0 <= page < self.num_pages:
            raise ValueError(f"cannot {action} page {page}: the pool has pages 0..{self.num_pages - 1}")

    def _fork_source(self, parent: Owner, child: Owner, num_tokens: int) -> list[int]:
        """The parent's pages, after checking that ``child`` is new and the parent holds ``num_tokens``."""
        if parent not in self._lists:
            raise ValueError(f"cannot fork from {parent!r}: it holds no pages (free it after forking, not before)")
        if child in self._lists:
            raise ValueError(f"cannot fork into {child!r}: it already holds pages; fork into a new owner")
        parent_pages = self._lists[parent]
        num_pages = -(-num_tokens // self.page_size)
        if num_tokens < 0 or num_pages > len(parent_pages):
            raise ValueError(
                f"cannot fork {num_tokens} tokens from {parent!r}: it holds {len(parent_pages)} pages of "
                f"{self.page_size} tokens"
            )
        if num_tokens % self.page_size and parent_pages[num_pages - 1] == NULL_PAGE:
            raise ValueError(
                f"cannot fork {num_tokens} tokens from {parent!r}: the page holding its last token was dropped "
                "from the window; fork at a position inside the window"
            )
        return parent_pages


def _require(condition: bool, message: str) -> None:
    """``assert`` that survives ``python -O``: check() is used in production debugging, not only in tests."""
    if not condition:
        raise AssertionError(message)
