"""Compressed pages (``max_pages_per_request``, ``jaxkv.serving.compaction``): a budget that
covers every token changes nothing; a compacted row keeps what ``EvictingLayer`` keeps for the
same tokens and budget and draws ``generate``'s tokens under that policy; shared prefix pages
are never written; no page leaks through compactions, aborts, preemptions and swaps; freed
pages may hold NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxkv.models.llama import Llama, LlamaConfig, param_shapes

from jaxkv.batch import PagedStorage
from jaxkv.cli.main import build_parser
from jaxkv.cli.serve import resolve_serve_config
from jaxkv.decoding.generate import generate
from jaxkv.eviction import EvictionSpec
from jaxkv.protocol import has
from jaxkv.quantization import QuantSpec
from jaxkv.serving import Engine
from jaxkv.serving.compaction import MAX_COMPACTIONS, PageBudget, _redundancy, compact_pages
from jaxkv.serving.engine import EngineConfig
from jaxkv.sharding import make_mesh
from tests.cases import VOCAB, greedy_reference, run_arrivals
from tests.serving.conftest import LLAMA, poisoned

SMALL = {"page_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, "kv_memory": 64 * 1024}
NEW_TOKENS = 12
# Pages of one token: a compaction then keeps max_pages - 1 tokens and the row writes the next
# one, which is what an EvictingLayer of max_pages - 1 slots attends over at each decode step.
ONE_TOKEN_PAGES = {"page_size": 1, "max_num_seqs": 4, "max_num_batched_tokens": 16, "kv_memory": 64 * 1024}
MAX_PAGES = 10


def prompts_of(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def one_head():
    """One layer and one K/V head: a policy's score of a token is the pool's (mean over layers and heads)."""
    return Llama(LlamaConfig(**LLAMA | {"num_hidden_layers": 1, "num_key_value_heads": 1}))


def test_options_are_checked_with_named_errors():
    with pytest.raises(ValueError, match="max_pages_per_request must be at least 2"):
        EngineConfig(max_pages_per_request=1)
    with pytest.raises(ValueError, match="compaction_policy must be one of"):
        EngineConfig(compaction_policy="tova")  # checked without a page budget too
    with pytest.raises(ValueError, match="compaction_choice must be one of"):
        EngineConfig(compaction_choice="layer")
    with pytest.raises(ValueError, match="compaction_policy must be one of"):
        EngineConfig(max_pages_per_request=4, compaction_policy="tova")
    with pytest.raises(ValueError, match="'pyramidkv' gives each layer its own budget: it needs compaction_choice"):
        EngineConfig(max_pages_per_request=8, compaction_policy="pyramidkv")
    with pytest.raises(ValueError, match="compaction_choice must be one of"):
        EngineConfig(max_pages_per_request=8, compaction_choice="layer")
    with pytest.raises(ValueError, match="max_pages_per_request=4: .*window"):
        EngineConfig(max_pages_per_request=4, compaction_policy="snapkv")  # 48 slots cannot hold its 64-token window
    with pytest.raises(ValueError, match="pass one of the two"):
        EngineConfig(max_pages_per_request=4, eviction=EvictionSpec("streaming_llm", budget=8))
    assert EngineConfig().page_budget() is None


def test_serve_flags_reach_the_engine():
    """``jaxkv serve --max-pages-per-request 6 --compaction-policy key_norm`` builds that budget, and
    ``--compaction-choice head`` chooses per layer and K/V head."""
    flags = ["serve", "--max-pages-per-request", "6", "--compaction-policy", "key_norm", "--kv-memory", "1MiB"]
    for extra, choice in (([], "pool"), (["--compaction-choice", "head"], "head")):
        served = resolve_serve_config(build_parser().parse_args(flags + extra))
        engine = Engine(Llama(LlamaConfig(**LLAMA)), served.engine)
        assert engine.kv.compaction.budget == PageBudget(6, 16, "key_norm", LLAMA["max_position_embeddings"], choice)


def test_a_budget_covering_every_token_gives_generates_tokens(model):
    """Prompts of up to 39 tokens and 12 new ones in pages of 4 never reach 13 pages: no
    compaction, exactly ``generate``'s tokens (Gemma: its sliding pool is not budgeted)."""
    prompts = prompts_of(0, [5, 39, 17, 26, 1])
    engine = Engine(model, max_pages_per_request=13, **SMALL)
    got = run_arrivals(engine, prompts, [0, 0, 1, 2, 3], NEW_TOKENS)
    assert got == greedy_reference(model, prompts, NEW_TOKENS)
    assert engine.stats().compactions == 0


@pytest.mark.parametrize("policy", ["streaming_llm", "key_norm", "h2o"])
def test_compacted_rows_keep_what_an_evicting_layer_keeps(one_head, policy):
    """Pages of one token, a budget of 10: after every compaction the row holds the positions an
    ``EvictingLayer`` of 9 slots holds after the same tokens (same scores, same ties), and the
    row draws the tokens ``generate`` draws with that layer."""
    spec = EvictionSpec(policy, budget=MAX_PAGES - 1)
    prompts = prompts_of(1, [7, 9])
    engine = Engine(one_head, max_pages_per_request=MAX_PAGES, compaction_policy=policy, **ONE_TOKEN_PAGES)
    tokens, kept = run_recording_compactions(engine, prompts)
    kept = {i: {length: held[0, 0] for length, held in by_length.items()} for i, by_length in kept.items()}
    result = generate(one_head, prompts, max_new_tokens=8, stop_tokens=(), eviction=spec)
    assert [t[len(p) :] for t, p in zip(tokens, prompts)] == [result.row(i) for i in range(len(prompts))]
    for i, by_length in kept.items():
        assert by_length, "no compaction happened"
        held = evicting_positions(one_head, spec, tokens[i], max(by_length))
        for length, positions in by_length.items():
            assert positions.tolist() == held[length], f"request {i} after {length} tokens"
    assert engine.stats().compactions >= sum(len(by_length) for by_length in kept.values())


SNAPKV_PAGES = 25  # pages of 4: a compaction keeps 96 tokens, SnapKV's window of 64 and 32 by score


def test_snapkv_prefills_a_long_prompt_whole_and_keeps_what_an_evicting_layer_keeps(one_head):
    """``snapkv``: a prompt of 150 tokens over a budget of 100 slots is prefilled whole, in chunks of
    16 (its row holds 38 pages meanwhile), then compacted once at its first decode: the row keeps
    the positions an ``EvictingLayer`` of 96 slots keeps after prefilling the prompt in one update
    (the window's 64 and the 32 with the most of its mean attention, pooled), and draws its first
    two tokens with them."""
    spec = EvictionSpec("snapkv", budget=(SNAPKV_PAGES - 1) * 4)
    prompt = prompts_of(4, [150])[0]
    engine = Engine(
        one_head, max_pages_per_request=SNAPKV_PAGES, compaction_policy="snapkv", **SMALL | {"kv_memory": 128 * 1024}
    )
    request = engine.add_request(prompt, max_tokens=3, ignore_eos=True)
    held, first = 0, None
    while engine.has_unfinished():
        engine.step()
        engine.kv.check()
        seq = engine.sequences[request][0]
        held = max(held, len(engine.kv.pools[0].manager.pages(seq.key)))
        if first is None and seq.key in engine.kv.compaction.compacted:
            first = held_positions(engine, seq)[0, 0, : (SNAPKV_PAGES - 1) * 4].tolist()
    assert held == -(-len(prompt) // 4) and engine.stats().compactions == 1
    graphdef, state = nnx.split(one_head)
    _, cache = nnx.merge(graphdef, state)(
        jnp.asarray([prompt]), jnp.arange(len(prompt))[None], one_head.init_cache(1, eviction=spec)
    )
    assert min(first) < len(prompt) - 64 and first == sorted(
        int(p) for p in np.asarray(cache.groups[0].slot_positions[0, 0, 0]) if p >= 0
    )
    result = generate(one_head, [prompt], max_new_tokens=2, stop_tokens=(), eviction=spec)
    assert engine.sequences[request][0].output[:2] == result.row(0)


@pytest.mark.parametrize("policy", ["streaming_llm", "key_norm", "h2o"])
def test_per_head_choices_keep_what_an_evicting_layer_keeps_in_every_layer_and_head(llama, policy):
    """``compaction_choice='head'``, pages of one token, a budget of 10, three layers of two K/V
    heads: after every compaction each layer and K/V head holds the positions an
    ``EvictingLayer`` of 9 slots holds there after the same tokens, and the rows draw
    ``generate``'s tokens with that layer."""
    spec = EvictionSpec(policy, budget=MAX_PAGES - 1)
    prompts = prompts_of(1, [7, 9])
    engine = Engine(
        llama, max_pages_per_request=MAX_PAGES, compaction_policy=policy, compaction_choice="head", **ONE_TOKEN_PAGES
    )
    tokens, kept = run_recording_compactions(engine, prompts)
    result = generate(llama, prompts, max_new_tokens=8, stop_tokens=(), eviction=spec)
    assert [t[len(p) :] for t, p in zip(tokens, prompts)] == [result.row(i) for i in range(len(prompts))]
    differ = False
    for i, by_length in kept.items():
        assert by_length, "no compaction happened"
        held = evicting_positions(llama, spec, tokens[i], max(by_length), every_head=True)
        for length, positions in by_length.items():
            np.testing.assert_array_equal(positions, held[length], err_msg=f"request {i} after {length} tokens")
            differ |= bool(np.any(positions != positions[:1, :1]))
    assert differ == (policy == "key_norm")  # its keys' norms differ per layer and head (H2O's mass: not here)


@pytest.mark.parametrize("policy", ["snapkv", "pyramidkv"])
def test_per_head_window_policies_keep_what_an_evicting_layer_keeps_after_a_whole_prompt(policy):
    """``snapkv`` and ``pyramidkv`` per layer and K/V head: a prompt longer than the budget is
    prefilled whole (chunks of 256), compacted once at its first decode, and then each layer and
    K/V head holds the positions an ``EvictingLayer`` (``PageBudget.layer_spec``) keeps after
    prefilling the prompt in one update; PyramidKV's layers keep 2496, 1280 and 64 tokens (its
    pages hold the first layer's; the others' slots left empty), and the row draws
    ``generate``'s first two tokens."""
    model = peaked_llama(LlamaConfig(**LLAMA | {"max_position_embeddings": 4096}))
    max_pages, page_size = 157, 16  # keeps 156 pages: 2496 tokens, PyramidKV's first layer at a mean of 1280
    engine = Engine(
        model, max_pages_per_request=max_pages, compaction_policy=policy, compaction_choice="head",
        page_size=page_size, max_num_seqs=2, max_num_batched_tokens=256, kv_memory=8 * 2**20, prefix_caching=False,
    )  # fmt: skip
    prompt = prompts_of(7, [2600])[0]
    request = engine.add_request(prompt, max_tokens=3, ignore_eos=True)
    positions = None
    while engine.has_unfinished():
        engine.step()
        seq = engine.sequences[request][0]
        if positions is None and seq.key in engine.kv.compaction.compacted:
            positions = held_positions(engine, seq)[..., : (max_pages - 1) * page_size]
    assert engine.stats().compactions == 1
    spec = engine.kv.compaction.budget.layer_spec(3)
    budgets = [2496, 1280, 64] if policy == "pyramidkv" else [2496] * 3
    assert spec.layer_budgets(3) == budgets and [int(n) for n in np.sum(positions[:, 0] >= 0, axis=-1)] == budgets
    graphdef, state = nnx.split(model)
    _, cache = nnx.merge(graphdef, state)(
        jnp.asarray([prompt]), jnp.arange(len(prompt))[None], model.init_cache(1, eviction=spec)
    )
    for layer, evicting in enumerate(jax.device_get(cache).layers):  # each [B, H_kv, its budget]
        for head, want in enumerate(np.sort(np.asarray(evicting.slot_positions[0]), axis=-1)):
            got = positions[layer, head]
            np.testing.assert_array_equal(got[got >= 0], want, err_msg=f"layer {layer}, K/V head {head}")
    result = generate(model, [prompt], max_new_tokens=2, stop_tokens=(), eviction=spec)
    assert engine.sequences[request][0].output[:2] == result.row(0)


def peaked_llama(config: LlamaConfig) -> Llama:
    """A random Llama whose attention is far from uniform (query and key weights N(0, 0.2), the rest
    N(0, 0.02)): a token's attention mass then differs from its neighbours' by more than the
    rounding of summing it in another order (chunk by chunk, or in one prefill)."""
    keys = iter(jax.random.split(jax.random.key(7), 16))
    scale = lambda name: 0.2 if name in ("wq", "wk") else 0.02  # noqa: E731
    params = {
        name: jnp.ones(shape) if "norm" in name else scale(name) * jax.random.normal(next(keys), shape)
        for name, shape in param_shapes(config).items()
    }
    return Llama(config, params)


def run_recording_compactions(engine: Engine, prompts) -> tuple[list[list[int]], dict[int, dict[int, np.ndarray]]]:
    """Run ``prompts`` (8 new tokens each) on an engine with pages of one token and ``MAX_PAGES``;
    returns each request's tokens and, per request and length T after a compaction (T = shift +
    kept), the positions its compacted slots hold ``[L, H_kv, MAX_PAGES - 1]``."""
    kept: dict[int, dict[int, np.ndarray]] = {i: {} for i in range(len(prompts))}
    for prompt in prompts:
        engine.add_request(prompt, max_tokens=8, ignore_eos=True)
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            shift = engine.kv.compaction.compacted.get(seq.key)
            if shift is not None:
                kept[seq.request_id][shift + MAX_PAGES - 1] = held_positions(engine, seq)[..., : MAX_PAGES - 1]
    return [engine.sequences[i][0].tokens for i in range(len(prompts))], kept


def held_positions(engine: Engine, seq) -> np.ndarray:
    """``[L, H_kv, S]``: the position each of ``seq``'s written full-pool slots holds, per layer (of
    the first full-pool group) and K/V head (-1: left empty by a compaction)."""
    group = next(g for g in engine.runner.cache.groups if has(g, PagedStorage) and g.pool == "full")
    pages = np.asarray(engine.kv.pools[0].manager.pages(seq.key))
    filled = seq.num_computed - engine.kv.compaction.compacted.get(seq.key, 0)
    held = np.asarray(group.slot_positions[:, pages])  # [L, pages, page_size, H_kv]
    return held.reshape(held.shape[0], -1, held.shape[-1])[:, :filled].transpose(0, 2, 1)


def evicting_positions(model, spec: EvictionSpec, tokens: list[int], longest: int, every_head: bool = False) -> dict:
    """The positions an ``EvictingLayer`` cache of ``spec`` holds after each length up to ``longest``
    (in position order), fed ``tokens`` one at a time: layer 0's first K/V head's, a list, or with
    ``every_head`` every layer's and K/V head's ``[L, H_kv, S]`` (each full after the first S tokens)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
    cache, held = model.init_cache(1, eviction=spec), {}
    for position in range(longest):
        _, cache = forward(state, jnp.asarray([[tokens[position]]]), jnp.asarray([[position]]), cache)
        slots = np.sort(np.asarray(cache.groups[0].slot_positions[:, 0]), axis=-1)  # [L, H_kv, S]
        held[position + 1] = slots if every_head else [int(p) for p in slots[0, 0] if p >= 0]
    return held


def pool_pages(engine: Engine, pages: list[int]) -> list[np.ndarray]:
    """Every full-pool leaf's contents at ``pages`` (every layer)."""
    groups = [group for group in engine.runner.cache.groups if has(group, PagedStorage) and group.pool == "full"]
    return [np.asarray(leaf[:, np.asarray(pages)]) for group in groups for leaf in jax.tree.leaves(group)]


def test_a_shared_prefix_page_is_never_written_by_a_compaction(llama):
    """B shares A's first two cached pages; B compacts (its kept tokens copied out of them into
    pages of its own): those pages hold the same bytes, A draws ``generate``'s tokens, and B
    no longer holds them."""
    prefix = prompts_of(2, [8])[0]
    a, b = prefix + [3], prefix + [5, 6, 7, 1, 2]
    engine = Engine(llama, max_pages_per_request=4, **SMALL)
    first = engine.add_request(a, max_tokens=7, ignore_eos=True)  # 15 slots at most: it never compacts
    engine.step()  # A's prompt: its full pages are cached
    second = engine.add_request(b, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.step()
    full = engine.kv.pools[0].manager
    shared = full.pages(engine.sequences[first][0].key)[:2]
    assert full.pages(engine.sequences[second][0].key)[:2] == shared
    before = pool_pages(engine, shared)
    while engine.has_unfinished():
        engine.step()
        if engine.stats().compactions:
            break
    assert engine.stats().compactions == 1
    assert not set(shared) & set(full.pages(engine.sequences[second][0].key))
    for old, new in zip(before, pool_pages(engine, shared), strict=True):
        np.testing.assert_array_equal(old, new)
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences[first][0].output == greedy_reference(llama, [a], 7)[0]


def budgeted_tokens(model, prompts, policy: str = "streaming_llm", max_pages: int = 4, **options) -> list[list[int]]:
    engine = Engine(model, max_pages_per_request=max_pages, compaction_policy=policy, **options)
    return [c.token_ids for c in engine.generate_many(prompts, max_tokens=NEW_TOKENS + 8, ignore_eos=True)]


# Attention-ranked policies without prefix caching: a page shared by several sequences sums the
# attention of all of them, so under prefix caching their choices depend on what else ran.
# (preemption, policy, prefix caching, max pages, prompt lengths, the tight pool's KiB)
SHORT, LONG = [30, 9, 22, 14, 3, 18], [130, 9, 110, 40, 3, 120]  # SnapKV's budget holds 64 tokens: longer prompts
LOADS = {
    "recompute": ("recompute", "streaming_llm", True, 4, SHORT, 20),
    "swap": ("swap", "streaming_llm", True, 4, SHORT, 20),
    "recompute-zipage": ("recompute", "zipage", False, 4, SHORT, 20),
    "swap-h2o": ("swap", "h2o", False, 4, SHORT, 20),
    "recompute-snapkv": ("recompute", "snapkv", False, SNAPKV_PAGES, LONG, 100),
}


@pytest.mark.parametrize("load", LOADS)
def test_no_page_leaks_after_compactions_aborts_and_preemptions(llama, load):
    """A pool too small for every row: rows compact, are preempted (recomputed, or swapped to the
    host tier, compacted pages and slot scores and all) and some are aborted; the others draw
    what they draw in a roomy pool (a row's compactions depend on its own tokens only), and
    every page comes back. The engine admits no more rows than the pool holds budgets, so rows
    outgrow it only through compactions' fresh pages; two preemptions are forced as well."""
    preemption, policy, prefix_caching, max_pages, lengths, tight_kib = LOADS[load]
    prompts = prompts_of(3, lengths)
    roomy = SMALL | {"prefix_caching": prefix_caching, "kv_memory": 16 * tight_kib * 1024}
    expected = budgeted_tokens(llama, prompts, policy, max_pages, **roomy)
    tight = roomy | {"kv_memory": tight_kib * 1024, "preemption": preemption, "host_kv_memory": 64 * 1024}
    engine = Engine(llama, max_pages_per_request=max_pages, compaction_policy=policy, **tight)
    ids = [engine.add_request(prompt, max_tokens=NEW_TOKENS + 8, ignore_eos=True) for prompt in prompts]
    for step in range(400):
        if not engine.has_unfinished():
            break
        if step in (6, 15):
            engine.abort(ids[step % len(ids)])
        if step in (9, 20) and engine.scheduler.running:
            engine.scheduler.preempt(engine.scheduler.running[-1])
        engine.step()
        engine.kv.check()
    stats = engine.stats()
    assert stats.compactions > MAX_COMPACTIONS and stats.preemptions > 0
    assert getattr(stats, preemption + "s") > 0
    aborted = {ids[6 % len(ids)], ids[15 % len(ids)]}
    for i, request_id in enumerate(ids):
        if request_id not in aborted:
            assert engine.sequences[request_id][0].output == expected[i], f"request {i}"
    pool = engine.kv.pools[0].manager
    assert pool.num_free == pool.num_usable and not engine.kv.compaction.compacted and not engine.kv.tiers.swapped


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o"])
def test_a_sequence_swapped_out_at_its_budget_resumes_and_compacts_there(llama, policy):
    """Preempted by swap when it fills its budget (compacted before, so its pages hold compacted
    positions and slot scores): it takes its pages back with no tokens, compacts in its next step
    as a running sequence, and draws the tokens of a run without the preemption."""
    prompt = prompts_of(8, [22])[0]
    options = SMALL | {"prefix_caching": False, "preemption": "swap", "host_kv_memory": 64 * 1024}
    expected = budgeted_tokens(llama, [prompt], policy, **options)[0]
    engine = Engine(llama, max_pages_per_request=4, compaction_policy=policy, **options)
    request = engine.add_request(prompt, max_tokens=NEW_TOKENS + 8, ignore_eos=True)
    swapped_at = []
    while engine.has_unfinished():
        engine.step()
        engine.kv.check()
        seq = engine.sequences[request][0]
        full = seq.num_computed - engine.kv.compaction.compacted.get(seq.key, 0) == engine.kv.compaction.budget.limit
        if full and seq.key in engine.kv.compaction.compacted and not swapped_at and seq in engine.scheduler.running:
            engine.scheduler.preempt(seq)
            assert seq.key in engine.kv.tiers.swapped  # not recomputed
            swapped_at.append(seq.num_computed)
    assert swapped_at and engine.stats().swaps == 1 and engine.stats().recomputes == 0
    assert engine.sequences[request][0].output == expected


def test_admits_no_more_rows_than_the_pool_holds_budgets(llama):
    """Long outputs under a budget in a pool of a few budgets: the engine runs as many rows as the
    pool holds budgets, never more (no preemption, so no compaction is repeated), and draws the
    tokens a roomy pool draws."""
    prompts, max_pages = prompts_of(4, [10, 5, 12, 8, 3, 9]), 4
    expected = budgeted_tokens(llama, prompts, max_pages=max_pages, **SMALL)
    engine = Engine(llama, max_pages_per_request=max_pages, **SMALL | {"kv_memory": 20 * 1024})
    budgets = engine.kv.pools[0].manager.num_usable // max_pages
    assert 2 <= budgets < len(prompts)
    engine.warmup()
    compiled = compact_pages._cache_size()  # one compaction per row count, compiled by warmup
    ids = [engine.add_request(prompt, max_tokens=NEW_TOKENS + 8, ignore_eos=True) for prompt in prompts]
    rows = []
    while engine.has_unfinished():
        engine.step()
        rows.append(len(engine.scheduler.running))
    assert max(rows) == budgets and engine.stats().preemptions == 0
    assert engine.stats().compactions > len(prompts) and compact_pages._cache_size() == compiled
    assert [engine.sequences[i][0].output for i in ids] == expected


def test_zipage_redundancy_is_a_softmax_over_the_filled_slots():
    """Two equal keys and an orthogonal one: the equal ones are the more redundant, the shares sum
    to 1 over the filled slots and an empty slot gets none."""
    keys = jnp.asarray([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [5.0, 5.0]]).reshape(1, 1, 4, 1, 2)
    filled = jnp.asarray([True, True, True, False]).reshape(1, 1, 4, 1)
    redundancy = np.asarray(_redundancy(keys, filled)).reshape(4)
    assert redundancy[0] == redundancy[1] > redundancy[2] > 0 and redundancy[3] == 0
    np.testing.assert_allclose(redundancy.sum(), 1.0, rtol=1e-6)


def test_nan_in_freed_pages_changes_nothing(model):
    """After every step, every page no row holds (and the null page) of every pool is set to NaN:
    compacted rows never read a slot they do not hold (Gemma: its sliding pool, not budgeted,
    frees the pages its window left)."""
    prompts = prompts_of(4, [30, 9, 22])
    expected = budgeted_tokens(model, prompts, prefix_caching=False, **SMALL)
    engine = Engine(model, max_pages_per_request=4, prefix_caching=False, **SMALL)
    ids = [engine.add_request(prompt, max_tokens=NEW_TOKENS + 8, ignore_eos=True) for prompt in prompts]
    while engine.has_unfinished():
        engine.step()
        engine.runner.cache = poisoned(engine)
    assert engine.stats().compactions > 0
    assert [engine.sequences[i][0].output for i in ids] == expected


@pytest.mark.parametrize("choice", ["pool", "head"])
@pytest.mark.parametrize(
    "quantization", [None, QuantSpec(nbits=8, residual_length=0, q_group_size=8)], ids=["float32", "int8"]
)
def test_compacted_slots_hold_the_kv_of_the_positions_they_say(llama, quantization, choice):
    """Layer 0's K/V of a token depend on the token and its position only: after the compactions
    of a 30-token prompt prefilled under a budget of 4 pages (``key_norm``: keys differ per layer
    and head, and so do the choices per head), each slot of the row holds, in each of layer 0's
    K/V heads, exactly what an engine without a budget wrote at the position the slot says it
    holds there (RoPE'd at that position; int8 pages: codes and scales move together)."""
    prompt = prompts_of(5, [30])[0]
    options = SMALL | {"quantization": quantization}
    budget = {"max_pages_per_request": 4, "compaction_policy": "key_norm", "compaction_choice": choice}
    budgeted, plain = Engine(llama, **budget, **options), Engine(llama, **options)
    for engine in (budgeted, plain):
        engine.add_request(prompt, max_tokens=4, ignore_eos=True)
        engine.step()
        while engine.scheduler.running[0].num_computed < len(prompt):
            engine.step()
    seq, other = budgeted.scheduler.running[0], plain.scheduler.running[0]
    assert budgeted.stats().compactions >= 2
    positions = held_positions(budgeted, seq)  # [L, H_kv, S]
    assert np.all(positions >= 0) and (choice == "head") == bool(np.any(positions != positions[:1, :1]))
    pages, plain_pages = (np.asarray(e.kv.pools[0].manager.pages(s.key)) for e, s in ((budgeted, seq), (plain, other)))
    slots = np.arange(positions.shape[-1])
    held = kv_leaves(budgeted, pages[slots // 4], slots % 4)  # each [L, S, H_kv, ...]
    for head, at in enumerate(positions[0]):
        wrote = kv_leaves(plain, plain_pages[at // 4], at % 4)
        for got, expected in zip(held, wrote, strict=True):
            np.testing.assert_array_equal(got[0, :, head], expected[0, :, head])


def kv_leaves(engine: Engine, pages: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """The first full-pool group's K and V leaves (codes and scales when quantized) at slots
    ``(pages, offsets)`` ``[S]``: each ``[L, S, H_kv, ...]``."""
    group = next(g for g in engine.runner.cache.groups if has(g, PagedStorage) and g.pool == "full")
    return [np.asarray(leaf[:, pages, offsets]) for leaf in jax.tree.leaves((group.key_pages, group.value_pages))]


@pytest.mark.filterwarnings("ignore:.*is not divisible by mesh axis:UserWarning")
def test_compaction_on_a_mesh_equals_one_device():
    """Pages over ``data`` (4), K/V heads over ``model`` (2): compacted rows (Zipage's score, its
    slot scores sharded like the pages) draw the tokens one device draws, and the compactions and
    steps leave every leaf of the cache where the layout puts it."""
    prompts = prompts_of(6, [30, 9])
    options = SMALL | {"max_pages_per_request": 4, "compaction_policy": "zipage", "prefix_caching": False}
    mesh = make_mesh({"data": 4, "model": 2})
    sharded = Engine(Llama(LlamaConfig(**LLAMA), mesh=mesh), **options)
    got = sharded.generate_many(prompts, max_tokens=NEW_TOKENS + 8, ignore_eos=True)
    assert sharded.stats().compactions > 0
    assert [c.token_ids for c in got] == budgeted_tokens(
        Llama(LlamaConfig(**LLAMA)), prompts, "zipage", prefix_caching=False, **SMALL
    )
    cache = sharded.runner.cache
    laid_out = jax.tree.map(lambda leaf, sharding: leaf.sharding.is_equivalent_to(sharding, leaf.ndim), cache,
                            cache.shardings())  # fmt: skip
    assert all(jax.tree.leaves(laid_out))


@pytest.mark.parametrize("prompt_length", [6, 30])
def test_parallel_samples_compact_on_their_own(llama, prompt_length):
    """``n = 2`` greedy samples under a budget: a prompt below it is forked (the samples share its
    pages, then each compacts, copying out of them); one compacted while prefilled is not (the
    second sample is computed like a new request). Either way both draw the tokens one request
    draws alone, and every page comes back."""
    prompt = prompts_of(7, [prompt_length])[0]
    alone = budgeted_tokens(llama, [prompt], **SMALL)[0]
    engine = Engine(llama, max_pages_per_request=4, **SMALL)
    got = engine.generate_many([prompt], n=2, max_tokens=NEW_TOKENS + 8, ignore_eos=True)
    assert [c.token_ids for c in got] == [alone, alone]
    assert engine.stats().compactions >= 2
    pool = engine.kv.pools[0].manager
    assert pool.num_free == pool.num_usable and not engine.kv.compaction.compacted
