"""The two-tier page ledger (device pools and the host tier, ``jaxkv.serving.host_tier``) driven by the
real scheduler and KV manager over a model of what each page holds: admissions with prefix hits in either
tier, demotions of evicted cached pages, promotions, preemption by swap or recompute, resumes and aborts.

No JAX compute here: the device pools and the step's copies are modelled on the host, so every example
is fast. The engine's copies themselves (``ModelRunner.move_pages``) are checked in test_engine_tiers.py.
"""

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jaxkv.layers.paged import NULL_PAGE
from jaxkv.serving.host_tier import HostPage, HostTier
from jaxkv.serving.kv_manager import PREEMPTION_MODES, KVCacheManager, prefix_key
from jaxkv.serving.pages import page_hashes, salt_key
from jaxkv.serving.requests import RequestOptions, SequenceState, Status
from jaxkv.serving.scheduler import Scheduler
from jaxkv.serving.sizing import PoolSizes
from jaxkv.serving.tier_manager import TierManager

PAGE_SIZE, WINDOW = 4, 6
FULL_BYTES, SLIDING_BYTES = 10, 7
# 11 usable full pages: a few requests of up to 26 tokens (7 pages) fill it, so admissions evict and preempt.
SIZES = PoolSizes(12, FULL_BYTES, 9, SLIDING_BYTES, WINDOW, PAGE_SIZE)
FULL_ONLY = PoolSizes(12, FULL_BYTES, 0, 0, None, PAGE_SIZE)
TOKENS = st.integers(0, 2)  # a tiny vocabulary: prompts share prefixes often
SALTS = st.sampled_from([None, None, "tenant"])


@dataclass(frozen=True)
class Held:
    """What a page holds: the K/V of logical page ``index`` of a sequence whose tokens up to the page's
    filled end are ``prefix``, under ``salt`` (the salt's key bytes)."""

    salt: bytes
    index: int
    prefix: tuple[int, ...]


def test_host_tier_evicts_least_recently_demoted_prefix_pages_never_pinned_ones():
    tier = HostTier(30)
    assert tier.demote("a", HostPage(10)) and tier.demote("swap", HostPage(10), pinned=True)
    assert tier.demote("b", HostPage(10)) and tier.demote("c", HostPage(10))  # evicts "a", the oldest
    assert tier.stored_keys() == ["swap", "b", "c"] and tier.used == 30 and tier.counters.dropped == 1
    assert not tier.can_pin(30) and tier.can_pin(20)
    assert not tier.demote("d", HostPage(25)), "a page that cannot fit beside the pinned ones is refused"
    assert tier.stored_keys() == ["swap", "b", "c"]
    page = tier.promote("b")
    assert page is not None and not tier.holds("b") and tier.promote("b") is None
    assert (tier.counters.pages_out, tier.counters.bytes_out) == (1, 10)
    tier.discard("swap")
    assert tier.pinned_bytes == 0 and tier.used == 10
    tier.check()
    with pytest.raises(ValueError, match="already stored"):
        tier.demote("c", HostPage(1))
    with pytest.raises(ValueError, match="host_kv_memory"):
        HostTier(-1)


def test_an_off_tier_stores_nothing():
    tier = HostTier(0)
    assert not tier.demote("a", HostPage(1)) and tier.num_pages == 0 and not tier.can_pin(1)


def test_swap_cost_rule_prices_a_page_round_trip_in_tokens():
    """Recompute the tail when it holds fewer than ``PAGE_COPY_TOKENS`` tokens a page, else swap."""
    assert TierManager.swap_pays(tokens=8, pages=2) and TierManager.swap_pays(tokens=4, pages=2)
    assert not TierManager.swap_pays(tokens=1, pages=1)


def test_swap_falls_back_to_recompute_when_pinned_pages_fill_the_host_tier():
    kv = KVCacheManager(FULL_ONLY, prefix_caching=False, host_bytes=2 * FULL_BYTES, preemption="swap")
    scheduler = Scheduler(kv, max_rows=3, token_budget=32)
    first, second = (SequenceState(i, 0, [i] * 8, RequestOptions(), 0.0) for i in range(2))
    scheduler.waiting.extend([first, second])
    chunks = scheduler.schedule()
    assert [chunk.count for chunk in chunks] == [8, 8] and not kv.take_moves()
    scheduler.computed(chunks)
    for seq in (first, second):
        seq.output.append(1)  # the token each chunk drew
    scheduler.preempt(second)  # two pages: the tier holds them
    scheduler.preempt(first)  # two more do not fit beside them
    assert (scheduler.stats.swaps, scheduler.stats.recomputes) == (1, 1)
    assert list(kv.tiers.swapped) == [second.key] and kv.tiers.host.pinned_bytes == 2 * FULL_BYTES
    assert [seq.num_computed for seq in scheduler.waiting] == [0, 0]
    kv.check()
    assert [page for page, _ in kv.take_moves().out["full"]] == [3, 4]  # the second sequence's pages
    assert kv.lookup(second).num_tokens == 8 and kv.lookup(first).num_tokens == 0


class TwoTierMachine(RuleBasedStateMachine):
    """The engine's loop over a modelled device: ``schedule``, the step's page copies (all reads, then all
    writes), the chunks written, ``computed``, a token drawn per finished chunk; plus aborts and forced
    preemptions. After every rule: both ledgers are consistent, no page is in two places, every running
    sequence finds its own tokens, every cached page in either tier holds what its hash says, every
    swapped sequence's host pages hold its tokens."""

    @initialize(
        capacity=st.sampled_from([0, 2 * FULL_BYTES, 6 * FULL_BYTES, 1000]),
        prefix_caching=st.booleans(),
        preemption=st.sampled_from(PREEMPTION_MODES),
        sliding=st.booleans(),
    )
    def setup(self, capacity, prefix_caching, preemption, sliding):
        self.kv = KVCacheManager(SIZES if sliding else FULL_ONLY, prefix_caching, capacity, preemption)
        self.scheduler = Scheduler(self.kv, max_rows=3, token_budget=16)
        self.device: dict[str, dict[int, Held]] = {pool.name: {} for pool in self.kv.pools}
        self.sequences: list[SequenceState] = []
        self.next_id = 0

    # --- the engine's actions --------------------------------------------------------------------
    def move_pages(self) -> None:
        """``ModelRunner.move_pages`` on the modelled device: every read, then every write."""
        moves = self.kv.take_moves()
        for name, pairs in moves.out.items():
            for page, host_page in pairs:
                host_page.arrays = [self.device[name][page]]
        for name, pairs in moves.into.items():
            for host_page, page in pairs:
                assert host_page.arrays is not None, "a host page was written to the device before it was read"
                self.device[name][page] = host_page.arrays[0]

    def write(self, seq: SequenceState, start: int, end: int) -> None:
        """The step writes ``seq``'s tokens ``start .. end - 1`` into its pages."""
        for pool in self.kv.pools:
            owned = pool.manager.pages(seq.key)
            for index in range(start // PAGE_SIZE, -(-end // PAGE_SIZE)):
                if owned[index] != NULL_PAGE:
                    filled = min(end, (index + 1) * PAGE_SIZE)
                    self.device[pool.name][owned[index]] = Held(
                        salt_key(seq.options.cache_salt), index, tuple(seq.tokens[:filled])
                    )

    # --- rules -----------------------------------------------------------------------------------
    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=20), salt=SALTS, max_tokens=st.integers(1, 6))
    def add_request(self, prompt, salt, max_tokens):
        options = RequestOptions(max_tokens=max_tokens, cache_salt=salt)
        self.kv.check_fits(len(prompt), len(prompt) + max_tokens, 1, 16)
        seq = SequenceState(self.next_id, 0, prompt, options, 0.0)
        self.next_id += 1
        self.sequences.append(seq)
        self.scheduler.waiting.append(seq)

    @rule(token=TOKENS)
    def step(self, token):
        chunks = self.scheduler.schedule()
        self.move_pages()
        for chunk in chunks:
            self.write(chunk.seq, chunk.start, chunk.start + chunk.count)
        self.scheduler.computed(chunks)
        for chunk in chunks:
            seq = chunk.seq
            if chunk.draws_next:
                seq.output.append((token + seq.num_tokens) % 3)
                if len(seq.output) >= seq.options.max_tokens:
                    self.scheduler.finish(seq)

    @precondition(lambda self: self.scheduler.running)
    @rule(index=st.integers(0, 63))
    def preempt(self, index):
        self.scheduler.preempt(self.scheduler.running[index % len(self.scheduler.running)])
        self.move_pages()

    @precondition(lambda self: any(not seq.finished for seq in self.sequences))
    @rule(index=st.integers(0, 63))
    def abort(self, index):
        live = [seq for seq in self.sequences if not seq.finished]
        self.scheduler.finish(live[index % len(live)])
        self.move_pages()

    # --- invariants ------------------------------------------------------------------------------
    @invariant()
    def ledgers_are_consistent_and_no_page_is_in_two_places(self):
        self.kv.check()
        owners = {seq.key for seq in self.scheduler.running}
        for pool in self.kv.pools:
            assert set(pool.manager.owners()) <= owners, "a sequence that does not run holds device pages"
        assert set(self.kv.tiers.swapped) <= {seq.key for seq in self.scheduler.waiting}

    @invariant()
    def running_sequences_find_their_tokens(self):
        for seq in self.scheduler.running:
            assert seq.status is Status.RUNNING
            for pool in self.kv.pools:
                owned = pool.manager.pages(seq.key)
                for index in range(pool.first_needed_page(seq.num_computed), -(-seq.num_computed // PAGE_SIZE)):
                    end = min(seq.num_computed, (index + 1) * PAGE_SIZE)
                    self.check_holds(self.device[pool.name][owned[index]], seq, index, end)

    @invariant()
    def cached_pages_in_either_tier_hold_what_their_hash_says(self):
        for pool in self.kv.pools:
            for page in range(1, pool.manager.num_pages):
                page_hash = pool.manager.page_hash(page)
                if page_hash is not None:
                    self.check_hash(self.device[pool.name][page], page_hash)
        for key in self.kv.tiers.host.stored_keys():
            if len(key) == 2:  # a prefix page: (pool, hash)
                assert key == prefix_key(key[0], key[1])
                self.check_hash(self.kv.tiers.host.get(key).arrays[0], key[1])

    @invariant()
    def swapped_pages_hold_their_sequences_tokens(self):
        waiting = {seq.key: seq for seq in self.scheduler.waiting}
        for owner, swapped in self.kv.tiers.swapped.items():
            seq = waiting[owner]
            for sources in swapped.pages.values():
                for index, source in enumerate(sources, start=swapped.num_registered):
                    if source != NULL_PAGE:
                        end = min(swapped.num_tokens, (index + 1) * PAGE_SIZE)
                        self.check_holds(self.kv.tiers.host.get(source.key).arrays[0], seq, index, end)

    @staticmethod
    def check_holds(held: Held, seq: SequenceState, index: int, end: int) -> None:
        assert (held.salt, held.index) == (salt_key(seq.options.cache_salt), index)
        assert len(held.prefix) >= end and held.prefix[:end] == tuple(seq.tokens[:end])

    @staticmethod
    def check_hash(held: Held, page_hash: bytes) -> None:
        assert len(held.prefix) == (held.index + 1) * PAGE_SIZE, "a cached page is not full"
        assert page_hashes(held.prefix, PAGE_SIZE, held.salt)[-1] == page_hash

    def teardown(self):
        for seq in self.sequences:
            if not seq.finished:
                self.scheduler.finish(seq)
        self.move_pages()
        self.kv.check()
        assert not self.kv.tiers.swapped and self.kv.tiers.host.pinned_bytes == 0
        assert all(len(key) == 2 for key in self.kv.tiers.host.stored_keys()), "a swapped page outlived its sequence"
        for pool in self.kv.pools:
            assert pool.manager.num_used == 0 and pool.manager.num_free == pool.manager.num_usable
        assert sorted(self.scheduler.free_rows) == [0, 1, 2]


TwoTierMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)
TestTwoTiers = TwoTierMachine.TestCase


def test_lookup_asks_each_page_once():
    """A prefix hit found in one pass over the chain: 4 cached pages then misses ask the pool 5
    times, not once per page for every shorter prefix tried (with a disk tier each ask may be a
    file's stat)."""
    kv = KVCacheManager(FULL_ONLY, prefix_caching=True)
    first = SequenceState(0, 0, list(range(20)), RequestOptions(), 0.0)
    assert kv.allocate(first, 20, kv.lookup(first)) is not None
    first.num_computed = 20
    kv.computed(first)
    second = SequenceState(1, 0, list(range(16)) + [99] * 24, RequestOptions(), 0.0)
    manager, asked = kv.pools[0].manager, []
    cached = manager.cached
    manager.cached = lambda page_hash: asked.append(page_hash) or cached(page_hash)
    hit = kv.lookup(second)
    assert hit.num_tokens == 16 and len(hit.pages["full"]) == 4 and len(asked) == 5
