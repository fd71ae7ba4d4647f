"""The step plan (``jaxkv.serving.plan``): built from the real scheduler and KV manager without a
model (rows, new pages, moves, copies, compactions, a window's dropped pages), and the model
runner's persistent block tables, changed row by row by the plans, equal to the whole rebuild
(``plan.block_tables``, the oracle) after every plan of busy workloads: with a model-free
loop over many seeds, and in the engine (preemption by swap and recompute, prefix hits, forks,
compactions, drafts), whose greedy tokens still equal ``generate``'s."""

import random

import numpy as np
import pytest

from jaxkv.layers.paged import FULL_POOL, NULL_PAGE, SLIDING_POOL
from jaxkv.serving import Engine
from jaxkv.serving.compaction import PageBudget
from jaxkv.serving.kv_manager import KVCacheManager
from jaxkv.serving.parallel_sampling import fork_sequences
from jaxkv.serving.plan import BlockTables, RowUpdate, StepPlan, block_tables, plan_step, row_shifts
from jaxkv.serving.requests import RequestError, RequestOptions, SequenceState
from jaxkv.serving.scheduler import Scheduler
from jaxkv.serving.sizing import PoolSizes
from jaxkv.serving.speculation import NgramProposer, Speculation, SpeculativeConfig
from tests.cases import VOCAB, greedy_reference

PAGE_SIZE, WINDOW, PAGE_BYTES = 4, 6, 10
FULL_ONLY = PoolSizes(12, PAGE_BYTES, 0, 0, None, PAGE_SIZE)  # 11 usable pages
WITH_WINDOW = PoolSizes(14, PAGE_BYTES, 9, PAGE_BYTES, WINDOW, PAGE_SIZE)
MAX_MODEL_LEN = 48


def sequence(request_id: int, prompt, **options) -> SequenceState:
    return SequenceState(request_id, 0, list(prompt), RequestOptions(**options), 0.0)


def drawn(chunks, scheduler: Scheduler) -> None:
    """The step ran: each chunk that computed its sequence's last token draws token 1."""
    for chunk in chunks:
        if chunk.draws_next:
            chunk.seq.output.append(1)
    scheduler.computed(list(chunks))


def test_a_plan_holds_each_rows_chunk_its_new_pages_and_the_moves():
    """Two admissions: each row whole; decodes: nothing until a page boundary, then one new page
    per row from its old length on; a swap: the row emptied and its pages read; the resume:
    written into fresh pages on a free row, sent whole."""
    kv = KVCacheManager(FULL_ONLY, prefix_caching=False, host_bytes=10 * PAGE_BYTES, preemption="swap")
    scheduler = Scheduler(kv, max_rows=3, token_budget=32)
    first, second = sequence(0, [5] * 6), sequence(1, [6] * 6)
    scheduler.waiting.extend([first, second])
    plan = plan_step(scheduler, scheduler.schedule())
    assert [(chunk.seq, chunk.start, chunk.count) for chunk in plan.chunks] == [(first, 0, 6), (second, 0, 6)]
    assert plan.tables == {FULL_POOL: (RowUpdate(0, 0, (1, 2)), RowUpdate(1, 0, (3, 4)))}
    assert not plan.moves and plan.copies == {} and plan.shifts == ()
    drawn(plan.chunks, scheduler)
    for _ in range(2):  # positions 6 and 7: the second page still holds them
        plan = plan_step(scheduler, scheduler.schedule())
        assert [(chunk.start, chunk.count) for chunk in plan.chunks] == [(first.num_computed, 1)] * 2
        assert plan.tables == {FULL_POOL: ()}
        drawn(plan.chunks, scheduler)
    plan = plan_step(scheduler, scheduler.schedule())  # position 8: a third page each
    assert plan.tables == {FULL_POOL: (RowUpdate(0, 2, (5,)), RowUpdate(1, 2, (6,)))}
    drawn(plan.chunks, scheduler)
    scheduler.preempt(second)
    plan = plan_step(scheduler)
    assert plan.chunks == () and plan.tables == {FULL_POOL: (RowUpdate(1, 0, ()),)}
    assert [page for page, _ in plan.moves.out[FULL_POOL]] == [3, 4, 6]
    plan = plan_step(scheduler, scheduler.schedule())
    assert second.row == 2  # rows are handed out oldest free first
    resumed = tuple(page for _, page in plan.moves.into[FULL_POOL])
    assert plan.tables[FULL_POOL][-1] == RowUpdate(2, 0, resumed)
    assert block_tables(kv, scheduler.running, 3, MAX_MODEL_LEN)[FULL_POOL][2, :3].tolist() == list(resumed)


def test_a_fork_makes_a_plan_of_its_own_with_its_copy_and_the_childs_row():
    """``n=2``: once the first sequence computed its prompt, the child shares its full page and
    copies the partial one: the fork's plan runs nothing, copies that page and writes the child's row."""
    kv = KVCacheManager(FULL_ONLY, prefix_caching=True)
    scheduler = Scheduler(kv, max_rows=3, token_budget=32)
    first = sequence(0, range(6), n=2)
    families = {0: [first]}
    scheduler.waiting.append(first)
    drawn(plan_step(scheduler, scheduler.schedule()).chunks, scheduler)
    forks = fork_sequences(scheduler, families, can_share=True)
    plan = plan_step(scheduler, copies=forks.copies)
    child = families[0][1]
    assert forks.children == [child] and child.row == 1
    assert plan.chunks == () and plan.copies == {FULL_POOL: [(2, 3)]}
    assert plan.tables == {FULL_POOL: (RowUpdate(1, 0, (1, 3)),)}


def test_a_compaction_rewrites_its_row_and_its_shift():
    """Under a budget of 3 pages a sequence that needs a fourth is compacted into 2 pages and
    writes on in a third: the plan holds the compaction, the row rewritten from column 0 and the
    row's new shift."""
    budget = PageBudget(3, PAGE_SIZE, max_model_len=MAX_MODEL_LEN)
    kv = KVCacheManager(FULL_ONLY, prefix_caching=False, budget=budget)
    scheduler = Scheduler(kv, max_rows=2, token_budget=16)
    seq = sequence(0, range(12), max_tokens=8)
    scheduler.waiting.append(seq)
    plan = plan_step(scheduler, scheduler.schedule())
    assert plan.tables == {FULL_POOL: (RowUpdate(0, 0, (1, 2, 3)),)} and plan.shifts == ((0, 0),)
    drawn(plan.chunks, scheduler)
    plan = plan_step(scheduler, scheduler.schedule())  # position 12: a fourth page, over the budget
    [compaction] = plan.moves.compactions
    assert compaction.sources == [1, 2, 3] and len(compaction.destinations) == 2
    assert plan.tables == {FULL_POOL: (RowUpdate(0, 0, tuple(kv.pages(FULL_POOL, seq))),)}
    assert plan.shifts == ((0, kv.shift(seq)),) and kv.shift(seq) > 0


def test_a_window_that_leaves_pages_rewrites_the_row_from_the_first_page_it_left():
    """A sliding pool (window 6, pages of 4): once a decode no longer reads a page, its row is
    written from that page on (the null page there), the full pool's only where it grew."""
    kv = KVCacheManager(WITH_WINDOW, prefix_caching=False)
    scheduler = Scheduler(kv, max_rows=1, token_budget=16)
    seq = sequence(0, range(9), max_tokens=8)
    scheduler.waiting.append(seq)
    drawn(plan_step(scheduler, scheduler.schedule()).chunks, scheduler)  # 9 tokens: pages 0..2 of each pool
    plan = plan_step(scheduler, scheduler.schedule())  # position 9 reads from position 4 on: page 0 left
    sliding = kv.pages(SLIDING_POOL, seq)
    assert sliding[0] == NULL_PAGE
    assert plan.tables == {FULL_POOL: (), SLIDING_POOL: (RowUpdate(0, 0, tuple(sliding)),)}


# --- the persistent tables against the whole rebuild ------------------------------------------------


class Loop:
    """The engine's loop without a model: each step schedules (with drafts, if ``speculative``),
    applies its plan to persistent ``BlockTables``, draws random tokens (random drafts kept),
    reports them computed, forks in a plan of its own and finishes what reached its
    ``max_tokens``; between steps requests arrive (short prompts over 3 tokens: prefix hits),
    and some are aborted or preempted. Every plan is checked against the oracle."""

    def __init__(self, seed: int, sizes: PoolSizes, rows: int, speculative: bool, **kv_options):
        self.rng = random.Random(seed)
        self.kv = KVCacheManager(sizes, **kv_options)
        self.scheduler = Scheduler(self.kv, max_rows=rows, token_budget=16)
        shifted = self.kv.compaction.budget is not None
        self.tables = BlockTables(rows, self.kv.table_widths(MAX_MODEL_LEN), shifted=shifted)
        config = SpeculativeConfig(num_tokens=3, max_ngram=2, min_ngram=1, always_verify=True)
        self.speculation = (
            Speculation(config, NgramProposer(2, 1), self.kv, MAX_MODEL_LEN, lambda chunks, width: (0, 0, width))
            if speculative
            else None
        )
        self.families: dict[int, list[SequenceState]] = {}
        self.plans: list[StepPlan] = []

    def apply(self, plan: StepPlan) -> None:
        self.tables.apply(plan)
        self.plans.append(plan)
        running, rows = self.scheduler.running, len(self.scheduler.free_rows) + len(self.scheduler.running)
        expected = block_tables(self.kv, running, rows, MAX_MODEL_LEN)
        assert expected.keys() == self.tables.tables.keys()
        for name, table in expected.items():
            np.testing.assert_array_equal(
                self.tables.tables[name], table, err_msg=f"{name} pool, plan {len(self.plans)}"
            )
        shifts = row_shifts(self.kv, running, rows)
        assert shifts.keys() == self.tables.shifts.keys()
        for name, want in shifts.items():
            np.testing.assert_array_equal(self.tables.shifts[name], want)

    def arrive(self) -> None:
        request_id = len(self.families)
        prompt = [self.rng.randrange(3) for _ in range(self.rng.randrange(1, 20))]
        seq = sequence(request_id, prompt, max_tokens=self.rng.randrange(1, 12), n=self.rng.choice([1, 1, 2, 3]))
        try:
            self.kv.check_fits(len(prompt), len(prompt) + seq.options.max_tokens, seq.options.n, 16)
        except RequestError:
            return
        self.families[request_id] = [seq]
        self.scheduler.waiting.append(seq)

    def step(self) -> None:
        chunks = self.scheduler.schedule()
        if self.speculation is not None:
            chunks = self.speculation.plan(chunks)
        self.apply(plan_step(self.scheduler, chunks))
        accepted = [self.rng.randrange(len(chunk.draft) + 1) for chunk in chunks]
        for chunk, kept in zip(chunks, accepted):
            for token in [*chunk.draft[:kept], self.rng.randrange(3)] if chunk.draws_next else []:
                if len(chunk.seq.output) < chunk.seq.options.max_tokens:
                    chunk.seq.output.append(token)
        self.scheduler.computed(chunks, accepted)
        forks = fork_sequences(self.scheduler, self.families, can_share=True)
        self.apply(plan_step(self.scheduler, copies=forks.copies))
        for chunk in chunks:
            if len(chunk.seq.output) >= chunk.seq.options.max_tokens and not chunk.seq.finished:
                self.scheduler.finish(chunk.seq)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            if self.rng.random() < 0.5:
                self.arrive()
            if self.scheduler.running and self.rng.random() < 0.1:
                self.scheduler.finish(self.rng.choice(self.scheduler.running))  # an abort
            if self.scheduler.running and self.rng.random() < 0.1:
                self.scheduler.preempt(self.scheduler.running[-1])
            self.step()
            self.kv.check()


LOOPS = {
    "swap, prefix hits, forks": dict(sizes=FULL_ONLY, prefix_caching=True, host_bytes=8 * PAGE_BYTES),
    "window, drafts, recompute": dict(sizes=WITH_WINDOW, prefix_caching=True, speculative=True),
    "window, swap, no prefix caching": dict(sizes=WITH_WINDOW, prefix_caching=False, host_bytes=8 * PAGE_BYTES),
    "budget, swap, prefix hits": dict(
        sizes=FULL_ONLY,
        prefix_caching=True,
        host_bytes=8 * PAGE_BYTES,
        budget=PageBudget(3, PAGE_SIZE, max_model_len=MAX_MODEL_LEN),
    ),
}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("case", LOOPS)
def test_persistent_tables_equal_the_whole_rebuild_after_every_plan(case, seed):
    options = dict(LOOPS[case])
    loop = Loop(seed, options.pop("sizes"), rows=3, speculative=options.pop("speculative", False), **options)
    loop.run(120)
    stats = loop.scheduler.stats
    assert stats.preemptions > 0 and len(loop.plans) == 240
    assert any(plan.copies for plan in loop.plans) or case.startswith("budget")  # a compacted parent never forks
    if "swap" in case:
        assert stats.swaps > 0
    if "prefix hits" in case:
        assert loop.kv.prefix_stats().hit_tokens > 0
    if "budget" in case:
        assert loop.kv.num_compactions > 0
    if "drafts" in case:
        assert any(chunk.draft for plan in loop.plans for chunk in plan.chunks)


# --- in the engine ----------------------------------------------------------------------------------


def checked_tables(engine: Engine) -> list[int]:
    """Make ``engine``'s runner check, before every step it runs, that its block tables and shifts
    equal the whole rebuild; returns the list the number of rows each checked step ran grows on."""
    run, checked = engine.runner.run, []

    def checking(chunks):
        running, rows = engine.scheduler.running, engine.config.max_num_seqs
        for name, table in block_tables(engine.kv, running, rows, engine.max_model_len).items():
            np.testing.assert_array_equal(engine.runner.tables.tables[name], table)
        for name, shifts in row_shifts(engine.kv, running, rows).items():
            np.testing.assert_array_equal(engine.runner.tables.shifts[name], shifts)
        checked.append(len(chunks))
        return run(chunks)

    engine.runner.run = checking
    return checked


def prompts_of(seed: int, count: int) -> list[list[int]]:
    """Prompts over a shared 12-token prefix (prefix hits), 1 to 23 tokens more."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB, 12).tolist()
    return [prefix + rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 24, count)]


# Pools that hold about two of the requests below: preemptions, by swap and by recompute.
TIGHT = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, host_kv_memory=16 * 1024)
KV_MEMORY = {"Llama": 28 * 1024, "Gemma3": 20 * 1024}


def test_the_engines_tables_equal_the_rebuild_with_swaps_prefix_hits_and_forks(model):
    """A pool too small for every request (preemption by swap and recompute), a shared prefix
    (hits), ``n=2`` (forks): the tables equal the rebuild at every step and the greedy tokens
    equal ``generate``'s (Gemma: a sliding window of 8, whose rows drop pages)."""
    prompts = prompts_of(0, 8)
    engine = Engine(model, kv_memory=KV_MEMORY[type(model).__name__], **TIGHT)
    checked = checked_tables(engine)
    got = engine.generate_many(prompts, max_tokens=10, ignore_eos=True, n=2)
    stats = engine.stats()
    assert stats.swaps > 0 and stats.recomputes > 0 and stats.prefix_cache.hit_rate > 0
    assert len(checked) == stats.num_steps
    reference = greedy_reference(model, prompts, 10)
    assert [c.token_ids for c in got] == [tokens for tokens in reference for _ in range(2)]


@pytest.mark.parametrize("options", [
    dict(max_pages_per_request=4), dict(speculative=SpeculativeConfig(num_tokens=3, always_verify=True)),
], ids=["compactions", "drafts"])  # fmt: skip
def test_the_engines_tables_equal_the_rebuild_with_compactions_or_drafts(llama, options):
    """The same under a page budget of 4 pages (compactions: rows rewritten, shifts) or with
    drafts verified in every step (their pages granted after the schedule); the drafts change no
    greedy token."""
    prompts = prompts_of(1, 6)
    engine = Engine(llama, kv_memory=KV_MEMORY["Llama"], **TIGHT, **options)
    checked = checked_tables(engine)
    got = engine.generate_many(prompts, max_tokens=12, ignore_eos=True, n=2)
    stats = engine.stats()
    assert len(checked) == stats.num_steps
    if "speculative" in options:
        assert stats.preemptions > 0 and stats.speculation.steps > 0
        reference = greedy_reference(llama, prompts, 12)
        assert [c.token_ids for c in got] == [tokens for tokens in reference for _ in range(2)]
    else:
        assert stats.compactions > 0
