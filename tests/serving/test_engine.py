"""The serving engine on tiny models: continuous batching with staggered arrivals, chunked
prefill, preemption, prefix caching, forks and isolation give exactly what ``generate``
gives each request alone; the compiled step is compiled once per bucket."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.models.qwen3_5 import Qwen3_5, Qwen3_5Config

from jaxkv.cache import layer_types_of
from jaxkv.decoding.generate import generate
from jaxkv.decoding.sampling import RowSampling, Sampling, sample_rows, sampling_logits, top_k_top_p
from jaxkv.eviction import EvictionSpec
from jaxkv.layers.evicting import EvictingLayer
from jaxkv.quantization import QuantSpec
from jaxkv.serving import Engine
from jaxkv.serving.pages import NULL_PAGE
from tests.cases import VOCAB, greedy_reference, run_arrivals
from tests.serving.conftest import GEMMA, LLAMA

# Small pages, rows and budget: prompts span many pages and chunks, and rows fill up.
SMALL = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
NEW_TOKENS = 12


def prompts_of(seed: int, count: int, longest: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, longest, count)]


# The references run in batches of this many rows: generate compiles once per batch shape, and
# the file's tests ask for 1 to 16 prompts.
REFERENCE_ROWS = 16


def reference(model, prompts, new_tokens=NEW_TOKENS) -> list[list[int]]:
    """``generate``'s greedy tokens for each prompt, in a batch padded to ``REFERENCE_ROWS`` rows
    with copies of the first prompt (rows are independent), so the references share compiled code."""
    assert len(prompts) <= REFERENCE_ROWS
    padding = [prompts[0]] * (REFERENCE_ROWS - len(prompts))
    return greedy_reference(model, list(prompts) + padding, new_tokens)[: len(prompts)]


def test_staggered_arrivals_equal_generate(model):
    """Requests of mixed lengths arriving at different steps, chunked over many steps, with
    rows and pages recycled: each gets exactly ``generate``'s greedy tokens (Gemma: prompts
    past its window of 8)."""
    prompts = prompts_of(0, 16)
    engine = Engine(model, kv_memory=64 * 1024, **SMALL)
    got = run_arrivals(engine, prompts, [3 * (i // 2) for i in range(len(prompts))], NEW_TOKENS)
    assert got == reference(model, prompts)
    assert engine.stats().pages["full"].used == 0


def test_preempted_requests_finish_with_the_same_tokens(model):
    """A pool too small for every admitted request forces preemptions (recompute); every
    request still ends with the undisturbed tokens and every page comes back."""
    prompts = prompts_of(1, 10)
    engine = Engine(model, kv_memory=24 * 1024, **SMALL)
    got = engine.generate_many(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert engine.stats().preemptions > 0
    assert [c.token_ids for c in got] == reference(model, prompts)
    for pool in engine.kv.pools:
        pool.manager.check()
        assert pool.manager.num_free == pool.manager.num_usable


@pytest.mark.parametrize("shared", [23, 24, 30])
def test_prefix_hit_equals_miss(model, shared):
    """A request sharing a prefix with a finished one reuses its full pages and resumes prefill
    mid-prompt (shared lengths on and off a page boundary); its tokens equal a cold run."""
    rng = np.random.default_rng(shared)
    prefix = rng.integers(0, VOCAB, shared).tolist()
    first, second = prefix + [5, 6, 7], prefix + rng.integers(0, VOCAB, 9).tolist()
    engine = Engine(model, kv_memory=64 * 1024, **SMALL)
    warm = engine.generate_many([first], max_tokens=NEW_TOKENS, ignore_eos=True)
    hit = engine.generate_many([second], max_tokens=NEW_TOKENS, ignore_eos=True)[0]
    assert hit.num_cached_tokens == shared // 4 * 4 > 0
    assert [warm[0].token_ids, hit.token_ids] == reference(model, [first, second])


def test_whole_prompt_cached_still_computes_its_last_token(llama):
    """The same prompt twice: the second reuses every full page but the one holding the last
    prompt token, whose logits draw the first output."""
    prompt = prompts_of(2, 1, 60)[0][:32] + [1] * (32 - len(prompts_of(2, 1, 60)[0][:32]))
    engine = Engine(llama, kv_memory=64 * 1024, **SMALL)
    runs = [engine.generate_many([prompt], max_tokens=NEW_TOKENS, ignore_eos=True)[0] for _ in range(2)]
    assert runs[1].num_cached_tokens == 28  # 32 tokens: pages of 4, all but the last page
    assert runs[0].token_ids == runs[1].token_ids == reference(llama, [prompt])[0]


def test_cache_salt_isolates_tenants(llama):
    prompt = prompts_of(3, 1, 60)[0] * 2
    engine = Engine(llama, kv_memory=64 * 1024, **SMALL)
    runs = [
        engine.generate_many([prompt], max_tokens=4, ignore_eos=True, cache_salt=salt)[0]
        for salt in ("tenant-a", "tenant-b", "tenant-a", None)
    ]
    assert [run.num_cached_tokens > 0 for run in runs] == [False, False, True, False]
    assert len({tuple(run.token_ids) for run in runs}) == 1


@pytest.mark.parametrize("poison", [np.nan, 1e30])
def test_poisoned_free_pages_do_not_leak(model, poison):
    """Every page of the pool (the null page included) filled with NaN or huge values after a
    request finished: the next requests, given those pages, produce a clean run's tokens."""
    prompts = prompts_of(4, 6)
    engine = Engine(model, kv_memory=64 * 1024, prefix_caching=False, **SMALL)
    engine.generate_many(prompts[:2], max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.runner.cache = engine.runner.cache.replace(
        groups=tuple(
            g.replace(key_pages=jnp.full_like(g.key_pages, poison), value_pages=jnp.full_like(g.value_pages, poison))
            for g in engine.runner.cache.groups
        )
    )
    got = engine.generate_many(prompts[2:], max_tokens=NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in got] == reference(model, prompts[2:])


def test_no_compile_after_warmup(llama):
    """One executable per prefill bucket, all compiled by ``warmup``; none while serving."""
    engine = Engine(llama, kv_memory=64 * 1024, **SMALL)
    assert engine.config.prefill_buckets() == (0, 16)
    engine.warmup()
    assert engine.stats().num_compiled == 2
    engine.generate_many(prompts_of(5, 8), max_tokens=NEW_TOKENS, ignore_eos=True)
    assert engine.stats().num_compiled == 2
    wide = Engine(llama, kv_memory=64 * 1024, page_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    assert wide.config.prefill_buckets() == (0, 16, 32, 64)
    wide.warmup()
    wide.generate_many(prompts_of(6, 8, 100), max_tokens=NEW_TOKENS, ignore_eos=True)
    assert wide.stats().num_compiled == 4


def test_decode_only_steps_take_the_smallest_decode_bucket(llama):
    """16 rows: a decode-only step with at most 8 running rows runs 8 decode slots (and 8 sample
    slots), a step that prefills all 16; the tokens still equal ``generate``'s, sampled tokens do
    not depend on the step shape, and ``warmup`` compiled every shape."""
    engine = Engine(llama, kv_memory=256 * 1024, page_size=4, max_num_seqs=16, max_num_batched_tokens=16)
    assert engine.config.step_shapes() == ((16, 0, 1), (16, 16, 1), (8, 0, 1))
    engine.warmup()
    shapes, prepare = [], engine.runner.prepare

    def recorded(chunks, *tables):  # (decode slots, chunks) of each step
        inputs = prepare(chunks, *tables)
        shapes.append((inputs.packed.decode_tokens, len(chunks)))
        return inputs

    engine.runner.prepare = recorded
    prompts = prompts_of(7, 12)
    got = run_arrivals(engine, prompts, [0] * 10 + [30, 30], NEW_TOKENS)
    assert got == reference(llama, prompts)
    assert all(slots >= count for slots, count in shapes) and {slots for slots, _ in shapes} == {8, 16}
    assert engine.stats().num_compiled == 3
    sampling = Sampling(temperature=1.0, top_k=20)
    few = Engine(llama, kv_memory=256 * 1024, page_size=4, max_num_seqs=16, max_num_batched_tokens=16)
    alone = few.generate_many(prompts[:2], sampling, max_tokens=NEW_TOKENS, seed=3)  # 8-slot decode steps
    many = Engine(llama, kv_memory=256 * 1024, page_size=4, max_num_seqs=16, max_num_batched_tokens=16)
    crowded = many.generate_many(prompts[:2] + prompts[2:12], sampling, max_tokens=NEW_TOKENS, seed=3)
    assert [c.token_ids for c in alone] == [c.token_ids for c in crowded[:2]]


def test_n_samples_share_the_prompt_pages(llama):
    """``n=3``: the samples fork from the first after its prefill (full pages shared, the last
    prompt page copied). Greedy samples all equal the reference; sampled ones are reproducible
    with a seed and differ from each other."""
    prompt = prompts_of(7, 1, 60)[0] * 2 + [3]
    engine = Engine(llama, kv_memory=64 * 1024, **SMALL)
    greedy = engine.generate_many([prompt], max_tokens=NEW_TOKENS, ignore_eos=True, n=3)
    assert [c.index for c in greedy] == [0, 1, 2]
    assert all(c.token_ids == reference(llama, [prompt])[0] for c in greedy)
    at_once = engine.generate_many([prompt], max_tokens=1, ignore_eos=True, n=3)  # the first finishes at once
    assert [c.token_ids for c in at_once] == [greedy[0].token_ids[:1]] * 3
    hot = Sampling(temperature=1.5)
    runs = [
        Engine(llama, kv_memory=64 * 1024, **SMALL).generate_many([prompt], hot, max_tokens=8, n=3, seed=11)
        for _ in range(2)
    ]
    assert [c.token_ids for c in runs[0]] == [c.token_ids for c in runs[1]]
    assert len({tuple(c.token_ids) for c in runs[0]}) > 1


def test_forked_samples_hold_fewer_pages(llama):
    prompt = prompts_of(8, 1, 60)[0] * 3
    peaks = []
    for n in (1, 3):
        engine = Engine(llama, kv_memory=64 * 1024, **SMALL)
        engine.generate_many([prompt], max_tokens=4, ignore_eos=True, n=n)
        peaks.append(engine.stats().peak_pages_used)
    prompt_pages = len(prompt) // 4
    assert peaks[1] < 3 * peaks[0] and peaks[1] <= peaks[0] + 2 * (peaks[0] - prompt_pages + 1)


def test_abort_frees_pages_and_reports(llama):
    engine = Engine(llama, kv_memory=64 * 1024, **SMALL)
    keep = engine.add_request(prompts_of(9, 1)[0], max_tokens=NEW_TOKENS, ignore_eos=True)
    drop = engine.add_request(prompts_of(10, 1, 80)[0] + [1] * 30, max_tokens=NEW_TOKENS, ignore_eos=True)
    for _ in range(3):
        engine.step()
    assert engine.kv.pools[0].manager.pages(engine.sequences[drop][0].key)
    engine.abort(drop)
    assert engine.kv.pools[0].manager.pages(engine.sequences[drop][0].key) == []
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs if o.finished] == [(drop, "abort")]
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences[keep][0].finish_reason == "length"


class DigitTokenizer:
    """A stand-in tokenizer: token t decodes to the text ``f"{t} "``."""

    def decode(self, ids):
        return "".join(f"{t} " for t in ids)


def test_stop_tokens_and_strings(llama):
    prompt = prompts_of(11, 1)[0]
    expected = reference(llama, [prompt], 16)[0]
    engine = Engine(llama, kv_memory=64 * 1024, tokenizer=DigitTokenizer(), **SMALL)
    by_token = engine.generate_many([prompt], max_tokens=16, stop_token_ids=[expected[5]])[0]
    assert by_token.token_ids == expected[: expected.index(expected[5]) + 1] and by_token.finish_reason == "stop"
    stop = f"{expected[3]} {expected[4]}"
    by_text = engine.generate_many([prompt], max_tokens=16, stop=[stop], ignore_eos=True)[0]
    assert by_text.finish_reason == "stop" and stop not in by_text.text
    assert DigitTokenizer().decode(expected).startswith(by_text.text + stop)
    capped = engine.generate_many([prompt], max_tokens=3, ignore_eos=True)[0]
    assert (capped.token_ids, capped.finish_reason) == (expected[:3], "length")


def test_logprobs_are_the_model_distribution(llama):
    prompt = prompts_of(12, 1)[0]
    engine = Engine(llama, kv_memory=64 * 1024, **SMALL)
    done = engine.generate_many([prompt], max_tokens=4, ignore_eos=True, logprobs=3)[0]
    logits, _ = llama(jnp.asarray([prompt]), jnp.arange(len(prompt))[None], llama.init_cache(1, 64))
    expected = jax.nn.log_softmax(logits[0, -1])
    first = done.logprobs[0]
    assert first["token"] == done.token_ids[0] == first["top"][0][0] and len(first["top"]) == 3
    np.testing.assert_allclose(first["logprob"], expected[first["token"]], atol=1e-5)
    np.testing.assert_allclose([x for _, x in first["top"]], jnp.sort(expected)[::-1][:3], atol=1e-5)


def test_bad_requests_are_refused_with_the_fix(llama):
    engine = Engine(llama, kv_memory=16 * 1024, **SMALL)
    cases = {
        "empty": dict(prompt_ids=[]),
        "past max_model_len": dict(prompt_ids=[1] * 250, max_tokens=10),
        "need .* pages": dict(prompt_ids=[1] * 100, max_tokens=100),
        "must be in \\[0, 61\\)": dict(prompt_ids=[61]),
        "max_tokens must be >= 1": dict(prompt_ids=[1], max_tokens=0),
        "n must be >= 1": dict(prompt_ids=[1], n=0),
        "logprobs must be in": dict(prompt_ids=[1], logprobs=21),
        "stop strings need": dict(prompt_ids=[1], stop=["x"]),
        "exceed max_num_seqs": dict(prompt_ids=[1], n=5),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=message):
            engine.add_request(**kwargs)
    assert not engine.has_unfinished()


QWEN = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=("linear_attention", "full_attention"),
    max_position_embeddings=256,
)  # fmt: skip


def test_hybrid_recurrent_states_live_in_row_slots():
    """Qwen3.5's gated-DeltaNet states sit in one slot per row beside the pages: staggered
    arrivals, rows taken over by new requests, preemptions and n=2 samples all give
    ``generate``'s tokens; prefix caching is off for such a model (with a warning). One engine
    with a pool too small for every admitted request serves all three (one set of compiled steps)."""
    model = Qwen3_5(Qwen3_5Config(**QWEN))
    prompts = prompts_of(14, 12)
    with pytest.warns(UserWarning, match="without prefix caching"):
        Engine(model, kv_memory=12 * 1024, **SMALL)
    engine = Engine(model, kv_memory=12 * 1024, prefix_caching=False, **SMALL)
    got = run_arrivals(engine, prompts, [2 * i for i in range(len(prompts))], NEW_TOKENS)
    expected = reference(model, prompts)
    assert got == expected
    preempted = engine.stats().preemptions
    done = engine.generate_many(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert engine.stats().preemptions > preempted and [c.token_ids for c in done] == expected
    pair = engine.generate_many(prompts[:1], max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    assert [c.token_ids for c in pair] == [expected[0]] * 2


def chunked_greedy(model, prompt, eviction, chunk: int, new_tokens: int = NEW_TOKENS) -> list[int]:
    """One prompt through ``model`` on an evicting cache, its prefill in ``chunk``-token updates
    (what the engine runs for a request alone), then greedy decoding token by token."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
    cache, tokens = model.init_cache(1, eviction=eviction), list(prompt)
    for start in range(0, len(prompt), chunk):
        piece = tokens[start : start + chunk]
        positions = jnp.arange(start, start + len(piece))[None]
        logits, cache = forward(state, jnp.asarray(piece)[None], positions, cache)
    for _ in range(new_tokens):
        tokens.append(int(jnp.argmax(logits[0, -1])))
        logits, cache = forward(state, jnp.asarray(tokens[-1:])[None], jnp.asarray([[len(tokens) - 1]]), cache)
    return tokens[len(prompt) :]


# An attention-scored policy accumulated while decoding (H2O) on Llama, one scored at each
# update's end (SnapKV) on Gemma 3, whose sliding layers keep their pages, and PyramidKV's
# budgets by depth (15, 10, 5: entries paired, 10 slots each) on Llama.
EVICTION = {
    "llama": ("llama", EvictionSpec("h2o", budget=10, window=4)),
    "gemma3": ("gemma3", EvictionSpec("snapkv", budget=10, window=4)),
    "llama-pyramidkv": ("llama", EvictionSpec("pyramidkv", budget=10, window=4, beta=2)),
}


@pytest.mark.parametrize("case", EVICTION)
def test_evicted_rows_equal_generate_with_the_same_policy(case):
    """Evicted full-attention layers keep a budget of slots per engine row, beside the pages
    (Gemma's sliding layers) or instead of them (Llama): prompts of one chunk arriving at
    different steps, rows taken over by new requests, give ``generate``'s tokens with the
    same policy; a prompt chunked over many steps gives what a cache fed the same chunks
    gives. No prefix caching (with a warning), no pages for evicted layers."""
    kind, spec = EVICTION[case]
    model = Llama(LlamaConfig(**LLAMA)) if kind == "llama" else Gemma3(Gemma3Config(**GEMMA))
    prompts = prompts_of(21, 7, longest=16)
    with pytest.warns(UserWarning, match="without prefix caching"):
        Engine(model, kv_memory=64 * 1024, eviction=spec, **SMALL)
    engine = Engine(model, kv_memory=64 * 1024, eviction=spec, prefix_caching=False, **SMALL)
    got = run_arrivals(engine, prompts, [2 * (i // 3) for i in range(len(prompts))], NEW_TOKENS)
    result = generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_tokens=(), eviction=spec)
    assert got == [result.row(i) for i in range(len(prompts))]
    assert "full" not in engine.stats().pages
    rows = engine.config.max_num_seqs
    assert engine.sizes.state_bytes == EvictingLayer.kv_bytes(rows, 0, 2, 8, jnp.float32, slots=10) * sum(
        kind == "full_attention" for kind in layer_types_of(model.config)
    )
    long_prompt = prompts_of(22, 1, longest=60)[0] + [1] * 18  # 64 tokens: four whole chunks
    alone = engine.generate_many([long_prompt], max_tokens=NEW_TOKENS, ignore_eos=True)[0].token_ids
    assert alone == chunked_greedy(model, long_prompt, spec, SMALL["max_num_batched_tokens"])
    assert alone != reference(model, [long_prompt])[0]  # the budget of 10 did evict


def test_eviction_with_room_for_everything_serves_exactly(llama):
    """A budget that holds every token evicts nothing: chunked prefills, staggered arrivals and
    n=2 samples (each computed, not forked) give the uncompressed cache's tokens."""
    prompts = prompts_of(23, 8)
    spec = EvictionSpec("key_norm", budget=64, window=4)
    engine = Engine(llama, kv_memory="256KiB", eviction=spec, prefix_caching=False, **SMALL)
    got = run_arrivals(engine, prompts, [i for i in range(len(prompts))], NEW_TOKENS)
    expected = reference(llama, prompts)
    assert got == expected
    pair = engine.generate_many(prompts[:1], max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    assert [c.token_ids for c in pair] == [expected[0]] * 2
    with pytest.raises(ValueError, match="does not combine with quantization"):
        Engine(llama, kv_memory=64 * 1024, eviction=spec, quantization=QuantSpec(nbits=8, residual_length=0))


def test_unpaged_layer_types_and_budgets_are_refused():
    chunked = Llama(LlamaConfig(**LLAMA, layer_types=("chunked_attention",) * 3))
    with pytest.raises(ValueError, match="serves full_attention, sliding_attention.*chunked_attention"):
        Engine(chunked, kv_memory=64 * 1024)
    with pytest.raises(ValueError, match="kv_memory '1KiB' cannot hold"):
        Engine(Gemma3(Gemma3Config(**GEMMA)), kv_memory="1KiB")
    with pytest.raises(ValueError, match="must be a multiple of 16"):
        Engine(Llama(LlamaConfig(**LLAMA)), max_num_batched_tokens=40)


def test_row_sampling_follows_each_rows_parameters():
    """``top_k_top_p`` keeps what ``sampling_logits`` keeps, per row; greedy rows take the argmax;
    a row with top_k=1 always draws its argmax."""
    logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3
    settings = [Sampling(1.0, top_k=5), Sampling(1.0, top_p=0.7), Sampling(1.0, top_k=8, top_p=0.5), Sampling(1.0)]
    params = RowSampling.stack(settings)
    # Compiled, as in the engine's step (op by op, each op would compile on its own).
    filtered = jax.jit(top_k_top_p)(logits, jnp.asarray(params.top_k), jnp.asarray(params.top_p))
    for row, setting in enumerate(settings):
        want = jax.jit(sampling_logits, static_argnums=1)(logits[row : row + 1], setting)[0]
        assert np.array_equal(np.isfinite(filtered[row]), np.isfinite(want))
    rows = [Sampling(), Sampling(0.8, top_k=1), Sampling(), Sampling(2.0, top_k=1)]
    keys = jax.random.split(jax.random.key(1), 4)
    drawn = jax.jit(sample_rows)(logits, keys, RowSampling(*map(jnp.asarray, RowSampling.stack(rows))))
    assert drawn.tolist() == jnp.argmax(logits, axis=-1).tolist()


def test_paged_pools_are_sized_from_the_byte_budget(model):
    engine = Engine(model, kv_memory="256KiB", **SMALL)
    sizes, stats = engine.sizes, engine.stats()
    total = sizes.full_pages * sizes.full_page_bytes + sizes.sliding_pages * sizes.sliding_page_bytes
    assert total <= 256 * 1024 < total + max(sizes.full_page_bytes, sizes.sliding_page_bytes, 1)
    assert stats.max_concurrent_tokens == (sizes.full_pages - 1) * 4
    held = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(engine.runner.cache))
    assert held == total
    assert dataclasses.asdict(engine.config)["page_size"] == 4
    assert NULL_PAGE == 0


def test_paged_formula_equals_the_allocated_layer():
    from jaxkv.cache import Cache
    from jaxkv.layers.paged import Paging
    from jaxkv.memory import layer_bytes

    for rows, tokens in ((1, 16), (3, 100), (2, 300)):
        paging = Paging(page_size=16, num_pages=rows * -(-tokens // 16) + 1, max_length=tokens)
        cache = Cache.from_layer_types(["full_attention"], batch_size=rows, num_kv_heads=2, head_dim=8, paging=paging)
        expected = layer_bytes(
            "full_attention", batch_size=rows, seq_len=tokens, num_kv_heads=2, head_dim=8, dtype=jnp.float32,
            full_attention="paged",
        )  # fmt: skip
        assert cache.nbytes == expected


PAGE_FORMATS = {
    "int8": QuantSpec(nbits=8, residual_length=0, q_group_size=8),
    "e4m3": QuantSpec(format="e4m3", residual_length=0, q_group_size=8),
    "int4": QuantSpec(nbits=4, residual_length=0, q_group_size=8),
}
# Every format, and each model's pools with two formats. The paged layer is blind to the format
# (it quantizes each token on write and dequantizes on read, ``jaxkv.quantization``'s codecs, which
# tests/layers/test_quantized.py checks format by format); what a format changes in the pages is the
# codes' width (int4 packs two per byte, int8 and e4m3 one) and whether zero points are stored (int
# formats). Llama (one full-attention pool) takes int8 and int4, Gemma 3 (full and sliding pools)
# int4 and e4m3: the other two pairs would take paths these four take.
PAGE_CASES = [("llama", "int8"), ("llama", "int4"), ("gemma3", "int4"), ("gemma3", "e4m3")]


@pytest.mark.parametrize(
    ("model", "spec"), [(kind, PAGE_FORMATS[name]) for kind, name in PAGE_CASES],
    ids=[f"{kind}-{name}" for kind, name in PAGE_CASES], indirect=["model"],
)  # fmt: skip
def test_quantized_pages_match_a_static_quantized_cache(model, spec):
    """Pages stored as codes and scales: the engine's greedy tokens equal ``generate`` with a
    static cache quantized the same way (every token quantized on arrival); the pool holds
    more pages in the same bytes."""
    prompts = prompts_of(13, 6)
    engine = Engine(model, kv_memory=64 * 1024, quantization=spec, **SMALL)
    got = engine.generate_many(prompts, max_tokens=NEW_TOKENS, ignore_eos=True)
    result = generate(model, prompts, max_new_tokens=NEW_TOKENS, stop_tokens=(), quantization=spec)
    assert [c.token_ids for c in got] == [result.row(i) for i in range(len(prompts))]
    plain = Engine(model, kv_memory=64 * 1024, **SMALL)
    assert engine.sizes.full_pages > plain.sizes.full_pages
    assert f"{spec.format}{spec.bits}" in repr(engine.runner.cache)


def test_page_quantization_must_be_per_token_without_residual(llama):
    for spec in (QuantSpec(nbits=8), QuantSpec(nbits=8, residual_length=8, axis_key=-1, q_group_size=8)):
        with pytest.raises(ValueError, match="quantized token by token"):
            Engine(llama, kv_memory=64 * 1024, quantization=spec, **SMALL)
