"""Speculative decoding in the serving engine (issue 40): drafts verified in the packed step and
rolled back by position give exactly the engine's tokens without speculation (greedy), the
target's distribution (sampled), never reach the prefix cache, and are counted."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.models.qwen3_5 import Qwen3_5, Qwen3_5Config
from scipy import stats

from jaxkv.decoding.sampling import RowSampling, Sampling, row_logits
from jaxkv.quantization import QuantSpec
from jaxkv.serving import Engine
from jaxkv.serving.requests import RequestOptions, SequenceState
from jaxkv.serving.scheduler import Chunk
from jaxkv.serving.speculation import (
    PLAIN,
    RETRY,
    VERIFY,
    NgramProposer,
    Proposer,
    Speculation,
    SpeculativeConfig,
    ngram_drafts,
)
from jaxkv.serving.step import verify_rows
from tests.cases import VOCAB, greedy_reference, run_arrivals
from tests.serving.conftest import LLAMA
from tests.serving.test_engine import QWEN, SMALL

NEW_TOKENS = 20
# Every draft verified (the measured rule's choices depend on timing: tested on its own).
SPECULATIVE = SpeculativeConfig(num_tokens=3, min_ngram=1, always_verify=True)


def repeating_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts that repeat a random span (so prompt lookup finds n-grams), up to 33 tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(n)).tolist() * int(r) for n, r in zip(rng.integers(1, 12, count),
                                                                             rng.integers(1, 4, count))]  # fmt: skip


@dataclasses.dataclass
class Oracle(Proposer):
    """Proposes each sequence's true greedy continuation (``references`` by prompt; none for an
    unknown prompt), each draft replaced by a wrong token with probability ``wrong``: acceptances
    and rejections at random depths, which prompt lookup on a random model rarely gives."""

    references: dict[tuple[int, ...], list[int]]
    wrong: float
    rng: np.random.Generator = dataclasses.field(default_factory=lambda: np.random.default_rng(0))

    def propose(self, seqs, limits):
        drafts = []
        for seq, limit in zip(seqs, limits):
            truth = self.references.get(tuple(seq.prompt), [])[len(seq.output) : len(seq.output) + limit]
            drafts.append([(t + 1) % VOCAB if self.rng.random() < self.wrong else t for t in truth])
        return drafts


def speculating(model, oracle=None, **options) -> Engine:
    engine = Engine(model, speculative=options.pop("speculative", SPECULATIVE), **options)
    if oracle is not None:
        engine.speculation.proposer = oracle
    return engine


# --- the pieces ----------------------------------------------------------------------------------
def test_ngram_drafts_copy_what_followed_the_latest_match():
    tokens = np.array([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3])
    assert ngram_drafts(tokens, 3, max_ngram=3, min_ngram=1) == [5, 7, 1]  # the latest "1 2 3" is at 5
    assert ngram_drafts(tokens, 9, max_ngram=3, min_ngram=1) == [5, 7, 1, 2, 3]  # up to the end
    assert ngram_drafts(np.array([4, 5, 6, 5]), 2, max_ngram=3, min_ngram=1) == [6, 5]  # a 1-gram
    assert ngram_drafts(np.array([4, 5, 6, 5]), 2, max_ngram=3, min_ngram=2) == []
    assert ngram_drafts(np.array([7]), 2, max_ngram=3, min_ngram=1) == []
    assert ngram_drafts(tokens, 0, max_ngram=3, min_ngram=1) == []
    assert NgramProposer(2, 1).propose([], []) == []


def test_config_is_checked():
    for bad, match in [
        (dict(method="eagle"), "method"), (dict(num_tokens=0), "num_tokens"), (dict(num_tokens=16), "at most"),
        (dict(min_ngram=3, max_ngram=2), "min_ngram"),
        (dict(method="draft"), "draft_model"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig(**bad)
    with pytest.raises(TypeError, match="speculative"):
        Engine(Llama(LlamaConfig(**LLAMA)), speculative={"method": "ngram"})


def test_greedy_verification_keeps_the_argmax_prefix():
    """Row 0 keeps both drafts and takes the bonus token; row 1 keeps one; row 2 none; row 3 has
    no drafts (a plain draw); row 4's second draft is padding past its one real draft."""
    logits = jax.nn.one_hot(jnp.array([[3, 4, 5], [3, 4, 5], [3, 4, 5], [6, 0, 0], [3, 4, 5]]), 8) * 5.0
    drafts = jnp.array([[3, 4], [3, 7], [1, 4], [0, 0], [3, 4]])
    num_drafts = jnp.array([2, 2, 2, 0, 1])
    keys = jax.random.split(jax.random.key(0), 15).reshape(5, 3)
    accepted, tokens = verify_rows(logits, drafts, num_drafts, keys, RowSampling.stack([Sampling()] * 5))
    assert accepted.tolist() == [2, 1, 0, 0, 1]
    assert [row[: a + 1] for row, a in zip(tokens.tolist(), accepted.tolist())] == [
        [3, 4, 5], [3, 4], [3], [6], [3, 4],
    ]  # fmt: skip


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=5, top_p=0.9)])
def test_sampled_verification_draws_the_target_distribution(sampling):
    """20,000 draws of one verification (drafts d1, d2 against fixed target logits per position):
    the first token follows p0, the second (where d1 was kept) follows p1, chi-square p > 0.001;
    drafts are kept about as often as p0(d1) says."""
    vocab, draws = 8, 20000
    logits = jax.random.normal(jax.random.key(1), (3, vocab)) * 1.5
    params = RowSampling.stack([sampling] * 3)
    p = np.asarray(jax.nn.softmax(row_logits(logits, params), axis=-1), np.float64)
    d1, d2 = int(np.argsort(p[0])[-2]), int(np.argmax(p[1]))  # a likely, not the likeliest, first draft
    keys = jax.random.split(jax.random.key(2), draws * 3).reshape(draws, 3)

    def one(key_row):
        accepted, tokens = verify_rows(
            logits[None], jnp.array([[d1, d2]]), jnp.array([2]), key_row[None], RowSampling.stack([sampling])
        )
        return accepted[0], tokens[0]

    accepted, tokens = jax.jit(jax.vmap(one))(keys)
    accepted, tokens = np.asarray(accepted), np.asarray(tokens)
    first = np.bincount(tokens[:, 0], minlength=vocab)
    assert_follows(first, p[0])
    kept = accepted >= 1
    assert_follows(np.bincount(tokens[kept, 1], minlength=vocab), p[1])
    assert abs(kept.mean() - p[0, d1]) < 0.02


def assert_follows(counts: np.ndarray, p: np.ndarray) -> None:
    """Chi-square goodness of fit of ``counts`` to ``p`` over the tokens p gives mass."""
    support = p > 0
    assert counts[~support].sum() == 0
    expected = p[support] / p[support].sum() * counts.sum()
    assert stats.chisquare(counts[support], expected).pvalue > 1e-3


# --- greedy: the engine's tokens without speculation -----------------------------------------------
def test_ngram_speculation_equals_generate_with_staggered_arrivals(model):
    """Prompt lookup on repeating prompts (Gemma: past its sliding window of 8, whose pages leave
    as drafts come and go): staggered arrivals, chunked prefill, rows recycled; every request gets
    ``generate``'s greedy tokens, drafts were verified and some kept."""
    prompts = repeating_prompts(0, 10)
    engine = speculating(model, kv_memory=64 * 1024, **SMALL)
    got = run_arrivals(engine, prompts, [2 * (i // 2) for i in range(len(prompts))], NEW_TOKENS)
    assert got == greedy_reference(model, prompts, NEW_TOKENS)
    counters = engine.stats().speculation
    assert counters.steps > 0 and 0 < counters.accepted < counters.proposed
    assert engine.stats().pages["full"].used == 0


@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_accepted_and_rejected_drafts_equal_generate_under_preemption(model, wrong):
    """An oracle proposer (the true continuation, each draft wrong with probability ``wrong``) in
    a pool too small for every admitted request: preemptions (recompute), rollbacks at every
    depth, drafts past a page's end; every request equals ``generate`` and every page comes back."""
    prompts = repeating_prompts(1, 8)
    references = greedy_reference(model, prompts, NEW_TOKENS)
    oracle = Oracle({tuple(p): r for p, r in zip(prompts, references)}, wrong)
    engine = speculating(model, oracle, kv_memory=20 * 1024, **SMALL)
    got = engine.generate_many(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in got] == references
    assert engine.stats().preemptions > 0
    counters = engine.stats().speculation
    assert counters.proposed > 0
    assert (counters.accepted == counters.proposed) == (wrong == 0.0)
    assert (counters.accepted == 0) == (wrong == 1.0)
    for pool in engine.kv.pools:
        pool.manager.check()
        assert pool.manager.num_free == pool.manager.num_usable


def test_swap_preemption_with_drafts_equals_generate(llama):
    """Preempted sequences swapped to the host tier (and back) with drafts' K/V past their
    computed tokens in the swapped pages: every request equals ``generate``."""
    prompts = repeating_prompts(2, 8)
    references = greedy_reference(llama, prompts, NEW_TOKENS)
    oracle = Oracle({tuple(p): r for p, r in zip(prompts, references)}, 0.3)
    engine = speculating(llama, oracle, kv_memory=24 * 1024, host_kv_memory="1MiB", preemption="swap", **SMALL)
    got = engine.generate_many(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert engine.stats().swaps > 0
    assert [c.token_ids for c in got] == references


def test_quantized_pages_roll_back(model):
    """int8 pages: speculation gives the tokens of the same engine without it."""
    prompts = repeating_prompts(3, 6)
    quantization = QuantSpec(nbits=8, axis_key=0, axis_value=0, q_group_size=8, residual_length=0)
    plain = Engine(model, kv_memory=64 * 1024, quantization=quantization, **SMALL)
    expected = [c.token_ids for c in plain.generate_many(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)]
    oracle = Oracle({tuple(p): r for p, r in zip(prompts, expected)}, 0.3)
    engine = speculating(model, oracle, kv_memory=64 * 1024, quantization=quantization, **SMALL)
    got = engine.generate_many(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in got] == expected
    assert engine.stats().speculation.accepted > 0


class Letters:
    """A tokenizer: token t is the letter ``chr(97 + t % 26)``."""

    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


def test_stops_aborts_and_forks_with_drafts(llama):
    """A stop string inside an accepted run of drafts ends the text and the tokens where the
    engine without speculation ends them; a stop token likewise; ``n=2`` forks; an abort between
    steps frees the request's pages, drafts' included."""
    prompts = repeating_prompts(4, 4)
    references = greedy_reference(llama, prompts, NEW_TOKENS)
    text = Letters().decode(references[0])
    stop = text[9:11]
    options = dict(max_tokens=NEW_TOKENS, ignore_eos=True, stop=[stop], stop_token_ids=[references[1][7]], n=2)
    plain = Engine(llama, kv_memory=64 * 1024, tokenizer=Letters(), **SMALL).generate_many(prompts, **options)
    oracle = Oracle({tuple(p): r for p, r in zip(prompts, references)}, 0.0)
    engine = speculating(llama, oracle, kv_memory=64 * 1024, tokenizer=Letters(), **SMALL)
    got = engine.generate_many(prompts, **options)
    assert [(c.token_ids, c.text, c.finish_reason) for c in got] == [
        (c.token_ids, c.text, c.finish_reason) for c in plain
    ]
    assert got[0].text.find(stop) == -1 and got[0].finish_reason == "stop" and len(got) == 8
    request = engine.add_request(prompts[0], max_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(4):
        engine.step()
    assert engine.sequences[request][0].num_proposed > 0
    engine.abort(request)
    engine.step()
    assert not engine.has_unfinished() and engine.stats().pages["full"].used == 0


# --- the prefix cache never holds a draft ---------------------------------------------------------
def test_prefix_cache_pages_hold_only_verified_tokens(llama):
    """Every draft wrong (their K/V written past each sequence's computed tokens, often into the
    next page): every page the prefix cache registered holds exactly the K/V the engine without
    speculation registered under the same hash, and a later request on a prompt that covers a
    finished one's whole text hits those pages and still equals ``generate``."""
    prompts = repeating_prompts(5, 6)
    references = greedy_reference(llama, prompts, NEW_TOKENS)
    plain = Engine(llama, kv_memory=64 * 1024, **SMALL)
    plain.generate_many(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
    oracle = Oracle({tuple(p): r for p, r in zip(prompts, references)}, 1.0)
    engine = speculating(llama, oracle, kv_memory=64 * 1024, **SMALL)
    engine.generate_many(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert engine.stats().speculation.proposed > 0
    registered = registered_pages(engine)
    assert registered and registered.keys() <= registered_pages(plain).keys()
    expected = registered_pages(plain)
    for page_hash, contents in registered.items():
        np.testing.assert_allclose(contents, expected[page_hash], atol=1e-5)
    follow = prompts[-1] + references[-1] + [1, 2]
    hit = engine.generate_many([follow], max_tokens=4, ignore_eos=True)[0]
    assert hit.num_cached_tokens > len(prompts[-1])  # pages of its output's tokens too
    assert hit.token_ids == greedy_reference(llama, [follow], 4)[0]


def registered_pages(engine) -> dict[bytes, np.ndarray]:
    """The full pool's K/V ``[layers, 2, page_size, H_kv, D]`` of every page the prefix cache holds, by hash."""
    manager = engine.kv.pools[0].manager
    group = engine.runner.cache.groups[0]
    return {
        manager.page_hash(page): np.stack(
            [np.asarray(group.key_pages[:, page]), np.asarray(group.value_pages[:, page])], 1
        )
        for page in range(1, manager.num_pages)
        if manager.page_hash(page) is not None
    }


# --- the rule, the opt-out and the counters -----------------------------------------------------------
def test_opt_out_and_counters(llama):
    """A request that opts out gets no drafts; the per-request counters sum to the engine's; usage
    (the tokens made) is unchanged; a step that compiled is not timed for the rule."""
    prompts = repeating_prompts(6, 2)
    references = greedy_reference(llama, prompts, NEW_TOKENS)
    oracle = Oracle({tuple(p): r for p, r in zip(prompts, references)}, 0.3)
    engine = speculating(llama, oracle, kv_memory=64 * 1024, **SMALL)
    timed, observe = [], engine.speculation.observe
    engine.speculation.observe = lambda chunks, seconds: timed.append(seconds) or observe(chunks, seconds)
    ids = [
        engine.add_request(p, max_tokens=NEW_TOKENS, ignore_eos=True, speculative=s)
        for p, s in zip(prompts, [True, False])
    ]
    while engine.has_unfinished():
        engine.step()
    on, off = (engine.sequences[i][0] for i in ids)
    assert off.num_proposed == 0 and [on.output, off.output] == references and on.num_proposed > 0
    counters = engine.stats().speculation
    totals = (counters.proposed, counters.accepted, counters.steps)
    assert totals == (on.num_proposed, on.num_accepted, on.num_speculative_steps)
    assert counters.acceptance_rate == on.num_accepted / on.num_proposed
    assert counters.mean_accepted_length == 1 + on.num_accepted / on.num_speculative_steps
    assert len(timed) == engine.stats().num_steps - engine.stats().num_compiled > 0
    with pytest.raises(TypeError, match="speculative"):
        engine.add_request(prompts[0], speculative="yes")


@pytest.mark.parametrize("wrong", [0.0, 1.0])
def test_the_step_verifies_only_when_it_pays(llama, wrong):
    """Step times fixed (every plain shape 1.0 s, every verifying shape 1.5 s) and two requests
    decoding together, one opted out: the first verification is tried (a new sequence expects
    one kept draft: 3 tokens for 1.5 s against 2 for 1.0 s); drafts that are always kept (3) keep
    every later step verifying, drafts never kept stop it for good."""
    prompt = repeating_prompts(7, 1)[0]
    reference = greedy_reference(llama, [prompt], NEW_TOKENS)[0]
    config = dataclasses.replace(SPECULATIVE, always_verify=False)
    oracle = Oracle({tuple(prompt): reference}, wrong)
    engine = speculating(llama, oracle, kv_memory=64 * 1024, speculative=config, **SMALL)
    engine.speculation.step_seconds = {shape: 1.0 if shape[2] == 1 else 1.5 for shape in engine.config.step_shapes()}
    engine.speculation.observe = lambda chunks, seconds: None
    ids = [engine.add_request(prompt, max_tokens=NEW_TOKENS, ignore_eos=True, speculative=s) for s in (True, False)]
    while engine.has_unfinished():
        engine.step()
    on = engine.sequences[ids[0]][0]
    assert on.output == reference
    assert on.num_speculative_steps == (1 if wrong else -(-(NEW_TOKENS - 1) // 4))


def test_warmup_compiles_every_verifying_shape(llama):
    """The wide shapes (decode slots 1 + k tokens, decode-only buckets down to one slot) are
    compiled by ``warmup``; none after."""
    engine = speculating(llama, kv_memory=64 * 1024, **SMALL)
    assert engine.config.step_shapes() == ((4, 0, 1), (4, 16, 1), (4, 0, 4), (4, 16, 4), (1, 0, 4), (2, 0, 4))
    engine.warmup()
    compiled = engine.stats().num_compiled
    engine.generate_many(repeating_prompts(8, 6), max_tokens=NEW_TOKENS, ignore_eos=True)
    assert engine.stats().num_compiled == compiled == 6


# --- recurrent states, draft models and sampled requests ------------------------------------------
def test_qwen3_5_recurrent_states_roll_back():
    """Qwen3.5's gated-DeltaNet states (one slot per row, with rollback rings of k states):
    drafts kept and rejected at every depth, staggered arrivals, preemptions; every request equals
    ``generate``."""
    model = Qwen3_5(Qwen3_5Config(**QWEN))
    prompts = repeating_prompts(9, 8)
    references = greedy_reference(model, prompts, NEW_TOKENS)
    oracle = Oracle({tuple(p): r for p, r in zip(prompts, references)}, 0.3)
    engine = speculating(model, oracle, kv_memory=21 * 1024, prefix_caching=False, **SMALL)
    got = run_arrivals(engine, prompts, [2 * i for i in range(len(prompts))], NEW_TOKENS)
    assert got == references
    counters = engine.stats().speculation
    assert 0 < counters.accepted < counters.proposed and engine.stats().preemptions > 0


def test_draft_model_speculation_equals_generate(llama):
    """A separate tiny draft model (its own per-row cache) gives the target's tokens; the target
    drafting for itself has every draft accepted."""
    prompts = repeating_prompts(10, 6)
    references = greedy_reference(llama, prompts, NEW_TOKENS)
    draft = Llama(LlamaConfig(**LLAMA), seed=7)
    for drafter, all_kept in ((draft, False), (llama, True)):
        config = SpeculativeConfig(method="draft", num_tokens=3, draft_model=drafter, always_verify=True)
        engine = Engine(llama, kv_memory=64 * 1024, speculative=config, **SMALL)
        got = run_arrivals(engine, prompts, [i for i in range(len(prompts))], NEW_TOKENS)
        assert got == references
        counters = engine.stats().speculation
        assert counters.proposed > 0 and (counters.accepted == counters.proposed) == all_kept
    small_vocab = Llama(LlamaConfig(**LLAMA | {"vocab_size": VOCAB - 1}))
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(llama, speculative=SpeculativeConfig(method="draft", draft_model=small_vocab), **SMALL)


def test_sampled_tokens_follow_the_target_distribution(llama):
    """600 seeded requests at top-k 3, drafts the greedy continuation (often kept): the
    first three output tokens' distributions with speculation equal those without (chi-square
    test of homogeneity, p > 0.001 at each position)."""
    prompt = repeating_prompts(11, 1)[0]
    reference = greedy_reference(llama, [prompt], 3)[0]
    sampling, seeds = Sampling(temperature=1.0, top_k=3), range(600)
    options = dict(kv_memory=256 * 1024, page_size=4, max_num_seqs=16, max_num_batched_tokens=16)

    def outputs(engine):
        ids = [engine.add_request(prompt, sampling, max_tokens=3, ignore_eos=True, seed=s) for s in seeds]
        while engine.has_unfinished():
            engine.step()
        return np.array([engine.sequences[i][0].output for i in ids])

    plain = outputs(Engine(llama, **options))
    engine = speculating(llama, Oracle({tuple(prompt): reference}, 0.0), **options)
    speculated = outputs(engine)
    assert engine.stats().speculation.accepted > 100
    for position in range(3):
        counts = np.stack([np.bincount(x[:, position], minlength=VOCAB) for x in (plain, speculated)])
        counts = counts[:, counts.sum(0) > 0]
        assert stats.chi2_contingency(counts).pvalue > 1e-3


def one_decoding_sequence(proposer: Proposer | None = None, max_tokens: int = 8):
    """A ``Speculation`` (prompt lookup, unless ``proposer``) whose steps all have one shape per
    width, and a step of one decoding sequence that may make ``max_tokens`` tokens."""
    speculation = Speculation(
        SpeculativeConfig(), proposer or NgramProposer(4, 2), kv=None, max_model_len=1024,
        step_shape=lambda chunks, w: (1, 0, w),
    )  # fmt: skip
    return speculation, [Chunk(SequenceState(0, 0, [1, 2, 3], RequestOptions(max_tokens=max_tokens), 0.0), 2, 1)]


def test_untimed_shapes_are_tried_verifying_first():
    """The rule's exploration: a verifying shape not timed yet is tried, then the plain one (run
    plain to time it), then the measured rule decides: one decoding sequence expecting one kept
    draft pays for a verifying step up to twice the plain one's time."""
    speculation, chunks = one_decoding_sequence()
    assert speculation._decide(chunks, {0: 3}, None) == VERIFY
    speculation.step_seconds[(1, 0, 5)] = 1.0
    assert speculation._decide(chunks, {0: 3}, None) == PLAIN
    speculation.step_seconds[(1, 0, 1)] = 0.5
    assert speculation._decide(chunks, {0: 3}, None) == VERIFY
    speculation.step_seconds[(1, 0, 1)] = 0.4
    assert speculation._decide(chunks, {0: 3}, None) == PLAIN


def test_a_losing_verifying_shape_is_retried_ever_more_rarely():
    """A verifying shape that always loses is tried again after 64 losses, then 128, then 256."""
    speculation, chunks = one_decoding_sequence()
    speculation.step_seconds = {(1, 0, 1): 0.1, (1, 0, 5): 1.0}
    decisions = [speculation._decide(chunks, {0: 3}, None) for _ in range(500)]
    assert [n + 1 for n, decision in enumerate(decisions) if decision != PLAIN] == [64, 64 + 128, 64 + 128 + 256]
    assert {decisions[63], decisions[191], decisions[447]} == {RETRY}


def test_costly_proposals_are_charged_and_never_retried_when_they_cannot_win():
    """Proposals are charged to the step: at 0.1 s a plain step, one sequence bringing 3 drafts
    (expecting 1 kept) verifies with cheap proposals (prompt lookup's), waits as a losing shape
    (retried after 64 losses) with proposals of 0.15 s, and with proposals of 1 s (a model drafting
    for itself) never verifies, not even a retry: 4 tokens in 1.1 s lose to 0.1 s a token."""
    speculation, chunks = one_decoding_sequence()
    speculation.step_seconds = {(1, 0, 1): 0.1}
    assert speculation._decide(chunks, {0: 3}, 1e-4) == VERIFY
    for proposing, retried in ((0.15, [64]), (1.0, [])):
        speculation.losses, speculation.patience = {}, {}
        decisions = [speculation._decide(chunks, {0: 3}, proposing) for _ in range(100)]
        assert [n + 1 for n, decision in enumerate(decisions) if decision != PLAIN] == retried


@dataclasses.dataclass
class Priced(Proposer):
    """Predicts ``seconds`` for any call; proposes nothing."""

    seconds: float

    def propose(self, seqs, limits):
        return [[] for _ in seqs]

    def cost(self, seqs, limits):
        return self.seconds


def test_a_predicted_cost_is_charged_whole_and_times_the_plain_shape_first():
    """A proposer's predicted cost (a draft's catch-up) is charged whole to the step, however many
    tokens the sequence has left: 10 s never verifies, 0.01 s does; with a predicted cost and the
    plain shape untimed, the step runs plain first."""
    speculation, chunks = one_decoding_sequence(Priced(10.0), max_tokens=1000)
    assert speculation._proposal_cost(chunks, {0: 3}) == 10.0
    assert speculation._decide(chunks, {0: 3}, 10.0) == PLAIN  # plain shape untimed
    speculation.step_seconds = {(1, 0, 1): 0.1}
    assert [speculation._decide(chunks, {0: 3}, 10.0) for _ in range(200)] == [PLAIN] * 200
    assert speculation._decide(chunks, {0: 3}, 0.01) == VERIFY


def test_a_draft_model_that_cannot_pay_never_proposes(llama):
    """The target drafting for itself under the measured rule, its predicted calls made costly (a
    fed token 1 s): the engine never runs the draft model and equals plain decoding."""
    prompts = repeating_prompts(11, 4)
    config = SpeculativeConfig(method="draft", num_tokens=3, draft_model=llama)
    engine = Engine(llama, kv_memory=64 * 1024, speculative=config, **SMALL)
    engine.warmup()
    engine.speculation.proposer.token_seconds = 1.0
    got = run_arrivals(engine, prompts, [0, 0, 1, 2], NEW_TOKENS)
    assert got == greedy_reference(llama, prompts, NEW_TOKENS)
    assert engine.stats().speculation.proposed == 0 and engine.speculation.proposer.calibration is None
