"""The paged pool's host-side ledger: hash chains, LRU reuse, prefix-cache hits, forks, windows, and a
stateful model of an engine driving it (admissions, decode steps, forks, preemptions, aborts).

No JAX here: the ledger is plain Python, so every test is fast.
"""

import hashlib
import os
import struct
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxkv.serving.pages import NULL_PAGE, PageManager, PoolExhausted, page_hashes, salt_key

# blake2b(16 bytes) of tokens 1..4 as int64 little-endian, then of that digest and tokens 5..8: the format is
# persisted in nobody's memory but the engine's, yet a change here would silently split caches across versions.
PINNED_CHAIN = ["087a24230771ee662be37e5493b333d7", "8222aab65152a8711ac413a3333a672c"]


def snapshot(pm: PageManager) -> tuple:
    """Everything observable about the ledger (except the free queue's order)."""
    return (
        pm.usage(),
        {owner: pm.pages(owner) for owner in pm.owners()},
        [pm.refcount(page) for page in range(pm.num_pages)],
        [pm.page_hash(page) for page in range(pm.num_pages)],
    )


def cached_request(pm: PageManager, owner: str, tokens: list[int]) -> list[bytes]:
    """Allocate ``owner``'s pages for ``tokens`` and register its full pages; returns the chain."""
    hashes = page_hashes(tokens, pm.page_size)
    pages = pm.allocate(owner, -(-len(tokens) // pm.page_size))
    for page, page_hash in zip(pages, hashes):
        pm.register(page, page_hash)
    return hashes


# --- hash chain ---------------------------------------------------------------------------------------------


def test_hash_chain_is_blake2b_over_int64_pages():
    first = hashlib.blake2b(struct.pack("<4q", 1, 2, 3, 4), digest_size=16).digest()
    second = hashlib.blake2b(first + struct.pack("<4q", 5, 6, 7, 8), digest_size=16).digest()
    chain = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], page_size=4)
    assert chain == [first, second]
    assert [h.hex() for h in chain] == PINNED_CHAIN


def test_hash_chain_is_the_same_in_another_process():
    code = "from jaxkv.serving.pages import page_hashes; print([h.hex() for h in page_hashes(range(1, 9), 4)])"
    env = os.environ | {"PYTHONHASHSEED": "12345", "JAX_PLATFORMS": "cpu"}
    output = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert output.strip() == str(PINNED_CHAIN)


def test_partial_last_page_gets_no_hash():
    assert len(page_hashes(list(range(11)), page_size=4)) == 2
    assert page_hashes([7, 7, 7], page_size=4) == []
    assert page_hashes(list(range(8)), page_size=4) == page_hashes(list(range(11)), page_size=4)


def test_parent_chaining_equals_one_shot_hashing():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    extra = salt_key("tenant")
    head = page_hashes(tokens[:8], 4, extra)
    tail = page_hashes(tokens[8:], 4, extra, parent=head[-1])
    assert head + tail == page_hashes(tokens, 4, extra)


def test_different_salts_give_disjoint_chains():
    tokens = [1, 2, 3, 4] * 4
    chains = [set(page_hashes(tokens, 4, salt_key(salt))) for salt in (None, "", "a", "b")]
    assert sum(len(chain) for chain in chains) == len(set().union(*chains)) == 16
    assert salt_key(None) == b"" and salt_key("") != b""


# --- allocation, LRU, prefix cache ---------------------------------------------------------------------------


def test_allocate_reuses_least_recently_freed_so_a_chain_head_is_evicted_last():
    pm = PageManager(num_pages=5, page_size=2)
    assert pm.allocate("a", 2) == [1, 2]
    hashes = cached_request(pm, "b", [1, 2, 3, 4])
    assert pm.pages("b") == [3, 4]
    pm.free("a")
    pm.free("b")  # tail first: the free queue is now 2, 1, 4, 3
    assert pm.allocate("c", 3) == [2, 1, 4]
    assert pm.lookup(hashes) == [3], "b's tail page was evicted, its head page still cached"
    assert pm.page_hash(4) is None and pm.num_cached == 1
    pm.check()


def test_cached_free_page_is_found_shared_and_dropped_when_evicted():
    pm = PageManager(num_pages=5, page_size=2)
    hashes = cached_request(pm, "a", [5, 6, 7, 8, 9])
    pm.free("a")
    assert pm.usage() == {"used": 0, "free": 4, "cached": 2, "usable": 4}
    hits = pm.lookup(hashes)
    assert hits == [1, 2]
    pm.share("b", hits)  # the cached pages leave the free queue: allocate cannot evict them now
    assert [pm.refcount(page) for page in hits] == [1, 1] and pm.num_free == 2
    assert pm.allocate("c", 2) == [4, 3]
    assert pm.lookup(hashes) == hits
    pm.free("c")
    pm.free("b")  # the free queue is now 3, 4, 2, 1
    pm.allocate("d", 3)  # takes b's tail page 2: its hash goes, and the chain breaks after page 1
    assert pm.lookup(hashes) == [1] and pm.page_hash(2) is None
    pm.check()


def test_register_keeps_the_first_copy_canonical():
    pm = PageManager(num_pages=5, page_size=2)
    (page_hash,) = cached_request(pm, "a", [1, 2])
    (duplicate,) = pm.allocate("b", 1)
    pm.register(duplicate, page_hash)
    assert pm.lookup([page_hash]) == [1] and pm.page_hash(duplicate) is None
    pm.register(1, b"another hash")  # the page already has a hash: no-op
    assert pm.page_hash(1) == page_hash and pm.lookup([b"another hash"]) == []
    pm.check()


def test_pool_exhausted_leaves_the_ledger_unchanged():
    pm = PageManager(num_pages=4, page_size=2)
    pm.allocate("a", 2)
    before = snapshot(pm)
    with pytest.raises(PoolExhausted, match=r"asked for 2 pages, 1 of 3 free.*kv_memory"):
        pm.allocate("b", 2)
    assert snapshot(pm) == before and not pm.can_allocate(2) and pm.can_allocate(1)
    pm.allocate("b", 1)
    before = snapshot(pm)
    with pytest.raises(PoolExhausted, match="asked for 1 pages, 0 of 3 free"):
        pm.fork("a", "child", 3)
    assert snapshot(pm) == before
    pm.check()


def test_free_is_idempotent_and_forgets_the_owner():
    pm = PageManager(num_pages=4, page_size=2)
    pm.allocate("a", 2)
    pm.free("a")
    after = snapshot(pm)
    pm.free("a")
    pm.free("never seen")
    assert snapshot(pm) == after and pm.owners() == [] and pm.pages("a") == []
    assert pm.num_free == pm.num_usable
    pm.check()


# --- forks and windows ---------------------------------------------------------------------------------------


def test_fork_shares_full_pages_and_copies_the_partial_one():
    pm = PageManager(num_pages=8, page_size=4)
    parent = pm.allocate("parent", 3)  # 10 tokens: two full pages and a partial one
    copies = pm.fork("parent", "child", 10)
    child = pm.pages("child")
    assert child[:2] == parent[:2] and child[2] not in parent
    assert copies == [(parent[2], child[2])]
    assert [pm.refcount(page) for page in parent] == [2, 2, 1]
    assert pm.fork("parent", "twin", 8) == [] and pm.pages("twin") == parent[:2]
    pm.check()


def test_drop_leading_releases_exactly_the_leading_pages_and_is_idempotent():
    pm = PageManager(num_pages=8, page_size=4)
    owned = pm.allocate("a", 4)
    pm.share("b", owned[:1])
    pm.drop_leading("a", 2)
    assert pm.pages("a") == [NULL_PAGE, NULL_PAGE, *owned[2:]]
    assert [pm.refcount(page) for page in owned] == [1, 0, 1, 1]
    after = snapshot(pm)
    pm.drop_leading("a", 2)
    pm.drop_leading("a", 1)
    assert snapshot(pm) == after
    with pytest.raises(ValueError, match="dropped from the window"):
        pm.fork("a", "child", 6)
    pm.fork("a", "child", 10)
    assert pm.pages("child")[:2] == [NULL_PAGE, NULL_PAGE]
    pm.free("a")
    pm.free("child")
    assert pm.num_used == 1  # b's page
    pm.check()


def test_sharing_null_page_keeps_a_dropped_placeholder():
    pm = PageManager(num_pages=4, page_size=2)
    hashes = cached_request(pm, "a", [1, 2, 3, 4])
    pm.free("a")
    pm.share("b", [NULL_PAGE, *pm.lookup(hashes)[1:]])  # a window that no longer reads page 0
    assert pm.pages("b") == [NULL_PAGE, 2] and pm.refcount(NULL_PAGE) == 0 and pm.num_used == 1
    pm.free("b")
    assert pm.num_free == pm.num_usable
    pm.check()


def test_misuse_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="at least 2"):
        PageManager(num_pages=1, page_size=4)
    pm = PageManager(num_pages=4, page_size=2)
    with pytest.raises(ValueError, match="free and holds no cached prefix"):
        pm.share("a", [1])
    with pytest.raises(ValueError, match="is free: register a page while its owner holds it"):
        pm.register(1, b"h")
    with pytest.raises(ValueError, match="NULL_PAGE"):
        pm.register(NULL_PAGE, b"h")
    with pytest.raises(ValueError, match="pages 0..3"):
        pm.refcount(4)
    assert pm.owners() == [] and pm.num_free == 3


# --- a stateful model of the engine --------------------------------------------------------------------------

PAGE_SIZE = 4
NUM_PAGES = 13  # 12 usable: small enough that admissions run out and cached pages get evicted
TOKENS = st.integers(0, 1)  # a two-token vocabulary, so prompts share prefixes and hit the cache
SALTS = st.sampled_from([None, "tenant"])
PICK = st.integers(0, 63)
OUTSIDE_WINDOW = st.sampled_from([0, 0, 1, 2])  # full pages a sliding-window request never reads again


@dataclass
class Request:
    tokens: list[int]
    salt: str | None
    hashes: list[bytes]  # the chain over its full pages, each registered when the page filled
    dropped: int = 0  # leading logical pages released by drop_leading
    compacted_slots: int | None = None  # once compacted: the slots its pages hold (never registered again)


@dataclass(frozen=True)
class Written:
    """What a page holds on the device: K/V of tokens [index * PAGE_SIZE, len(prefix)) of a sequence whose
    tokens up to there are ``prefix``, under ``salt``."""

    salt: str | None
    index: int
    prefix: tuple[int, ...]


def num_pages_for(num_tokens: int) -> int:
    return -(-num_tokens // PAGE_SIZE)


class PagePoolMachine(RuleBasedStateMachine):
    """Drives the ledger as the engine would, and models what each page holds on the device: a live request
    must always find its own tokens in its pages, and a cached page's hash must always match what it holds."""

    def __init__(self):
        super().__init__()
        self.pm = PageManager(NUM_PAGES, PAGE_SIZE)
        self.requests: dict[int, Request] = {}
        self.waiting: list[tuple[list[int], str | None]] = []  # preempted or not admitted, to add again
        self.written: dict[int, Written] = {}
        self.next_id = 0

    # engine actions, each checked as it happens

    def new_owner(self) -> int:
        self.next_id += 1
        return self.next_id

    def pick(self, index: int) -> int:
        return list(self.requests)[index % len(self.requests)]

    def allocate(self, owner: int, n: int) -> None:
        held = {page for other in self.pm.owners() for page in self.pm.pages(other)}
        exhausted = n > self.pm.num_free
        before = snapshot(self.pm)
        try:
            fresh = self.pm.allocate(owner, n)
        except PoolExhausted:
            assert exhausted and snapshot(self.pm) == before
            raise
        assert not exhausted and len(fresh) == n
        assert held.isdisjoint(fresh), "allocate handed out a page that an owner still holds"
        assert all(self.pm.page_hash(page) is None for page in fresh), "a reused page kept its cached hash"

    def write(self, owner: int, start: int) -> None:
        """The device writes the request's tokens from ``start`` on into its pages."""
        request = self.requests[owner]
        owned = self.pm.pages(owner)
        for index in range(start // PAGE_SIZE, len(owned)):
            end = min(len(request.tokens), (index + 1) * PAGE_SIZE)
            self.written[owned[index]] = Written(request.salt, index, tuple(request.tokens[:end]))

    def register_full_pages(self, owner: int) -> None:
        """Extend the request's chain over its newly full pages (from its last hash) and register them."""
        request = self.requests[owner]
        done = len(request.hashes)
        parent = request.hashes[-1] if request.hashes else None
        new = page_hashes(request.tokens[done * PAGE_SIZE :], PAGE_SIZE, salt_key(request.salt), parent)
        owned = self.pm.pages(owner)
        for index, page_hash in enumerate(new, start=done):
            self.pm.register(owned[index], page_hash)
            assert self.pm.lookup([page_hash]), "a registered hash is not found"
        request.hashes += new

    def admit(self, tokens: list[int], salt: str | None, outside_window: int) -> None:
        """Share the cached pages of the request's longest cached chain, allocate the rest. A sliding-window
        request skips the first ``outside_window`` full pages: it holds NULL_PAGE placeholders there."""
        owner = self.new_owner()
        hashes = page_hashes(tokens, PAGE_SIZE, salt_key(salt))
        dropped = min(outside_window, len(hashes))
        hits = self.pm.lookup(hashes[dropped:])
        self.pm.share(owner, [NULL_PAGE] * dropped + hits)
        reused = dropped + len(hits)
        try:
            self.allocate(owner, num_pages_for(len(tokens)) - reused)
        except PoolExhausted:
            self.pm.free(owner)
            self.waiting.append((tokens, salt))
            return
        self.requests[owner] = Request(tokens, salt, hashes[:reused], dropped)
        self.write(owner, reused * PAGE_SIZE)
        self.register_full_pages(owner)
        assert self.requests[owner].hashes == hashes, "the chain extended from a parent differs from one shot"

    def compacted_page(self, owner: int, index: int) -> Written:
        """What a compacted request's logical page ``index`` holds: tokens of its own, no prefix's."""
        return Written(f"compacted {owner}", index, ())

    def preempt_request(self, owner: int) -> None:
        request = self.requests.pop(owner)
        self.pm.free(owner)
        self.waiting.append((request.tokens, request.salt))

    # rules

    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=20), salt=SALTS, outside_window=OUTSIDE_WINDOW)
    def add_request(self, tokens, salt, outside_window):
        self.admit(tokens, salt, outside_window)

    @precondition(lambda self: self.waiting)
    @rule(index=PICK, outside_window=OUTSIDE_WINDOW)
    def resume(self, index, outside_window):
        self.admit(*self.waiting.pop(index % len(self.waiting)), outside_window)

    @precondition(lambda self: self.requests)
    @rule(index=PICK, new_tokens=st.lists(TOKENS, min_size=1, max_size=6))
    def step(self, index, new_tokens):
        owner = self.pick(index)
        request = self.requests[owner]
        if request.compacted_slots is not None:
            self.step_compacted(owner, len(new_tokens))
            return
        grown = request.tokens + new_tokens
        try:
            self.allocate(owner, num_pages_for(len(grown)) - len(self.pm.pages(owner)))
        except PoolExhausted:
            self.preempt_request(owner)
            return
        start, request.tokens = len(request.tokens), grown
        self.write(owner, start)
        self.register_full_pages(owner)

    def step_compacted(self, owner: int, num_new: int) -> None:
        """A compacted request's next tokens: pages of its own, written, never registered."""
        request = self.requests[owner]
        slots = request.compacted_slots + num_new
        held = len(self.pm.pages(owner))
        try:
            self.allocate(owner, num_pages_for(slots) - held)
        except PoolExhausted:
            self.preempt_request(owner)
            return
        request.compacted_slots = slots
        for index in range(held, num_pages_for(slots)):
            self.written[self.pm.pages(owner)[index]] = self.compacted_page(owner, index)

    @precondition(lambda self: self.requests)
    @rule(index=PICK, keep=st.integers(0, 63), first_uncached=st.integers(0, 6))
    def compact(self, index, keep, first_uncached):
        """Compact a full-attention request (no window dropped) into fewer pages: the destinations
        are its own unshared pages (cached ones only from ``first_uncached`` on, leaving the
        cache), else fresh ones; its other pages lose its reference."""
        owner = self.pick(index)
        request, before = self.requests[owner], self.pm.pages(owner)
        if request.dropped or not before:
            return
        num_pages = 1 + keep % len(before)
        reusable = [
            p for i, p in enumerate(before)
            if self.pm.refcount(p) == 1 and (i >= first_uncached or self.pm.page_hash(p) is None)
        ]  # fmt: skip
        fresh = self.pm.compaction_fresh_pages(owner, num_pages, first_uncached)
        assert fresh == max(num_pages - len(reusable), 0)
        ledger = snapshot(self.pm)
        try:
            sources, destinations = self.pm.compact(owner, num_pages, first_uncached)
        except PoolExhausted:
            assert fresh > self.pm.num_free and snapshot(self.pm) == ledger
            return
        assert sources == before and self.pm.pages(owner) == destinations and len(destinations) == num_pages
        assert destinations[: num_pages - fresh] == reusable[:num_pages]
        for logical, page in enumerate(destinations):
            assert self.pm.refcount(page) == 1 and self.pm.page_hash(page) is None
            self.written[page] = self.compacted_page(owner, logical)
        request.compacted_slots = num_pages * PAGE_SIZE

    @precondition(lambda self: self.requests)
    @rule(index=PICK, twice=st.booleans())
    def finish(self, index, twice):
        owner = self.pick(index)
        del self.requests[owner]
        self.pm.free(owner)
        if twice:
            after = snapshot(self.pm)
            self.pm.free(owner)
            assert snapshot(self.pm) == after

    @precondition(lambda self: self.requests)
    @rule(index=PICK)
    def preempt(self, index):
        self.preempt_request(self.pick(index))

    @precondition(lambda self: self.requests)
    @rule(index=PICK, cut=st.integers(0, 63))
    def fork(self, index, cut):
        owner = self.pick(index)
        request = self.requests[owner]
        if request.compacted_slots is not None:  # the engine never forks a compacted sequence
            return
        # At a position inside the window: the page holding its last token was not dropped.
        lowest = min(request.dropped * PAGE_SIZE + 1, len(request.tokens))
        num_tokens = lowest + cut % (len(request.tokens) - lowest + 1)
        num_full, partial = divmod(num_tokens, PAGE_SIZE)
        child = self.new_owner()
        before = snapshot(self.pm)
        try:
            copies = self.pm.fork(owner, child, num_tokens)
        except PoolExhausted:
            assert partial and self.pm.num_free == 0 and snapshot(self.pm) == before
            return
        assert copies == ([(self.pm.pages(owner)[num_full], self.pm.pages(child)[num_full])] if partial else [])
        for source, destination in copies:
            self.written[destination] = self.written[source]
        self.requests[child] = Request(
            request.tokens[:num_tokens], request.salt, request.hashes[:num_full], request.dropped
        )

    @precondition(lambda self: self.requests)
    @rule(index=PICK, count=st.integers(0, 5))
    def drop_leading(self, index, count):
        owner = self.pick(index)
        request = self.requests[owner]
        if request.compacted_slots is not None:  # compacted: a full-attention request, no window
            return
        count = min(count, len(request.tokens) // PAGE_SIZE)  # a window never drops the page being written
        before = self.pm.pages(owner)
        self.pm.drop_leading(owner, count)
        request.dropped = max(request.dropped, count)
        assert self.pm.pages(owner) == [NULL_PAGE] * request.dropped + before[request.dropped :]

    # invariants

    @invariant()
    def ledger_is_consistent(self):
        self.pm.check()
        assert sorted(self.pm.owners()) == sorted(self.requests)
        holders = Counter(page for owner in self.requests for page in self.pm.pages(owner) if page != NULL_PAGE)
        assert all(self.pm.refcount(page) == holders[page] >= 0 for page in range(NUM_PAGES))
        refcount_zero = sum(self.pm.refcount(page) == 0 for page in range(1, NUM_PAGES))
        cached = [page for page in range(1, NUM_PAGES) if self.pm.page_hash(page) is not None]
        assert self.pm.num_free == refcount_zero and self.pm.num_cached == len(cached)

    @invariant()
    def every_live_request_finds_its_own_tokens(self):
        holders = Counter(page for owner in self.requests for page in self.pm.pages(owner))
        for owner, request in self.requests.items():
            owned = self.pm.pages(owner)
            if request.compacted_slots is not None:  # its own pages, in order, held by it alone
                assert len(owned) == num_pages_for(request.compacted_slots)
                assert all(holders[page] == 1 for page in owned)
                assert [self.written[page] for page in owned] == [
                    self.compacted_page(owner, i) for i in range(len(owned))
                ]
                continue
            assert len(owned) == num_pages_for(len(request.tokens))
            assert owned[: request.dropped] == [NULL_PAGE] * request.dropped
            for index in range(request.dropped, len(owned)):
                page, end = owned[index], min(len(request.tokens), (index + 1) * PAGE_SIZE)
                held = self.written[page]
                assert (held.salt, held.index, held.prefix[:end]) == (request.salt, index, tuple(request.tokens[:end]))
                # Only full pages are shared (fork, prefix hits): a page two owners hold is never written again.
                assert holders[page] == 1 or end == (index + 1) * PAGE_SIZE, f"page {page} shared while partial"

    @invariant()
    def cached_pages_hold_what_their_hash_says(self):
        for page in range(1, NUM_PAGES):
            page_hash = self.pm.page_hash(page)
            if page_hash is not None:
                held = self.written[page]
                assert len(held.prefix) == (held.index + 1) * PAGE_SIZE, f"cached page {page} is not full"
                assert page_hashes(held.prefix, PAGE_SIZE, salt_key(held.salt))[-1] == page_hash

    def teardown(self):
        for owner in self.pm.owners():
            self.pm.free(owner)
        self.pm.check()
        assert self.pm.num_free == self.pm.num_usable and self.pm.num_used == 0


PagePoolMachine.TestCase.settings = settings(max_examples=600, stateful_step_count=60, deadline=None)
TestPagePool = PagePoolMachine.TestCase
