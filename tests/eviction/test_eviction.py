"""Eviction policies as cache layers (``jaxkv.eviction``, ``jaxkv.layers.evicting``).

The oracles: a budget that holds the whole sequence gives full attention's outputs (and a
compression ratio of 0 builds the very layers of the full cache); at a small budget, each
update's output is softmax attention over exactly the slots kept before it plus its own tokens,
computed here in NumPy; the scores the layer keeps equal the policies' definitions recomputed
here (H2O's accumulated mass, SnapKV's pooled window mass, key norms); StreamingLLM keeps sinks
and the most recent tokens at any chunking. kvpress itself is the oracle of
``tests/eviction/test_eviction_parity.py``.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import Cache, SlidingWindowLayer
from jaxkv.attention import attention, cached_attention
from jaxkv.decoding.beam import beam_search
from jaxkv.decoding.generate import generate
from jaxkv.decoding.speculative import PromptLookup, generate_speculative
from jaxkv.eviction import POLICIES, EvictionSpec
from jaxkv.layers.evicting import EvictingLayer
from jaxkv.memory import storage_rows
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.quantization import QuantSpec
from tests.cases import TINY_GEMMA, TINY_LLAMA

B, H_KV, H_Q, D = 2, 2, 4, 8
GROUP = H_Q // H_KV


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig(**TINY_LLAMA), seed=0)


@functools.partial(jax.jit, static_argnums=1)
def attend(cache, layer_idx, q, k, v, positions):
    """``cached_attention``, compiled once per shape (eager dispatch of its ops dominates tiny tests)."""
    return cached_attention(cache, layer_idx, q, k, v, positions)


def layer_cache(spec: EvictionSpec, max_length: int = 64, num_layers: int = 1) -> Cache:
    return Cache.from_layer_types(
        ["full_attention"] * num_layers, batch_size=B, num_kv_heads=H_KV, head_dim=D, max_length=max_length,
        eviction=spec, stacked=True,
    )  # fmt: skip


def random_kv(seed: int, length: int):
    q, k, v = (jax.random.normal(key, (B, heads, length, D)) for key, heads in
               zip(jax.random.split(jax.random.key(seed), 3), (H_Q, H_KV, H_KV)))  # fmt: skip
    return q, k, v


def ragged_positions(length: int, row_lengths) -> jnp.ndarray:
    """``[B, T]`` positions 0..n-1 of each row, right padded with -1."""
    return jnp.asarray([[t if t < n else -1 for t in range(length)] for n in row_lengths], jnp.int32)


def chunks(total: int, seed: int):
    """Random chunk sizes summing to ``total``."""
    rng, start = np.random.default_rng(seed), 0
    while start < total:
        size = int(rng.integers(1, 6))
        yield start, min(start + size, total)
        start += size


def numpy_attention(q, k, v, q_pos, kv_pos):
    """Softmax attention per row and query head over slots whose position is >= 0 and <= the
    query's: ``q`` ``[H_q, T, D]``, ``k``/``v`` ``[H_kv, S, D]``, ``kv_pos`` ``[H_kv, S]``."""
    out = np.zeros(q.shape)
    for h in range(H_Q):
        kh = h // GROUP
        for t, p in enumerate(q_pos):
            if p < 0:
                continue
            visible = (kv_pos[kh] >= 0) & (kv_pos[kh] <= p)
            logits = k[kh][visible] @ q[h, t] / np.sqrt(D)
            weights = np.exp(logits - logits.max())
            out[h, t] = (weights / weights.sum()) @ v[kh][visible]
    return out


# --- no eviction: the full cache's outputs ---------------------------------------------------
class LargeBudgetTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_large_budget_matches_full_cache(self):
        """Every policy, random chunk sizes, ragged rows (row 1 shorter, padded): every update's
        output equals the full static cache's, float32 within 1e-5, when the budget holds the
        whole sequence."""
        length, row_lengths = 20, (20, 13)
        q, k, v = random_kv(0, length)
        positions = ragged_positions(length, row_lengths)
        feed = self.variant(lambda cache, q, k, v, p: cached_attention(cache, 0, q, k, v, p))
        updates = [
            (q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], positions[:, start:end])
            for start, end in chunks(length, seed=1)
        ]
        full, wants = layer_cache(None), []
        for args in updates:  # the full cache's outputs, the same for every policy
            full, want = feed(full, *args)
            wants.append(want)
        for policy in POLICIES:
            evicting = layer_cache(EvictionSpec(policy, budget=24, window=4))
            for args, want in zip(updates, wants):
                evicting, got = feed(evicting, *args)
                real = np.asarray(args[-1] >= 0)[:, None, :, None]
                chex.assert_trees_all_close(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5, rtol=1e-5)
            np.testing.assert_array_equal(evicting.lengths, row_lengths)


@pytest.mark.parametrize("policy", POLICIES)
def test_compression_ratio_zero_builds_the_full_cache(model, policy):
    """Ratio 0 evicts nothing: the cache is the uncompressed one, so logits are identical."""
    spec = EvictionSpec(policy, compression_ratio=0.0)
    cache = model.init_cache(1, 32, eviction=spec)
    full = model.init_cache(1, 32)
    assert jax.tree.structure(cache) == jax.tree.structure(full)
    tokens = jnp.arange(1, 13)[None] % model.config.vocab_size
    positions = jnp.arange(12)[None]
    np.testing.assert_array_equal(model(tokens, positions, cache)[0], model(tokens, positions, full)[0])


def test_model_greedy_tokens_with_a_budget_holding_everything(model):
    """The tiny Llama through ``generate``: every policy's tokens equal the full cache's."""
    prompts = [[3, 14, 15, 9, 2, 6, 5], [35, 8, 9]]
    want = generate(model, prompts, max_new_tokens=10).tokens
    for policy in POLICIES:
        got = generate(model, prompts, max_new_tokens=10, eviction=EvictionSpec(policy, budget=24, window=4)).tokens
        np.testing.assert_array_equal(got, want, err_msg=policy)


# --- eviction: outputs over the kept slots, budgets, positions -----------------------------
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_outputs_attend_over_kept_slots_and_new_tokens(policy, jit):
    """At a budget of 8, each update's output is NumPy softmax attention over the slots the layer
    held before it plus the update's own tokens (per K/V head), and after it each row and head
    holds at most the budget, in position order, always including the recent window."""
    length, row_lengths, budget, window = 24, (24, 17), 8, 3
    q, k, v = random_kv(2, length)
    positions = ragged_positions(length, row_lengths)
    spec = EvictionSpec(policy, budget=budget, window=None if policy == "streaming_llm" else window)

    def feed(cache, q, k, v, positions):
        return cached_attention(cache, 0, q, k, v, positions)

    feed = jax.jit(feed) if jit else feed
    cache = layer_cache(spec)
    history_k = np.asarray(k)  # position p of every row: column p (positions are 0..n-1)
    for start, end in chunks(length, seed=3):
        held = np.asarray(cache.layer(0).slot_positions)
        sl = slice(start, end)
        cache, out = feed(cache, q[:, :, sl], k[:, :, sl], v[:, :, sl], positions[:, sl])
        for row in range(B):
            new = np.asarray(positions[row, start:end])
            kv_pos = np.concatenate([held[row], np.broadcast_to(new, (H_KV, new.size))], axis=1)
            safe = np.maximum(kv_pos, 0)
            keys = np.take_along_axis(history_k[row], safe[..., None], axis=1)
            values = np.take_along_axis(np.asarray(v)[row], safe[..., None], axis=1)
            want = numpy_attention(np.asarray(q)[row, :, start:end], keys, values, new, kv_pos)
            np.testing.assert_allclose(np.asarray(out[row]), want, atol=2e-5, rtol=2e-5)
        kept = np.asarray(cache.layer(0).slot_positions)
        lengths = np.asarray(cache.lengths)
        for row in range(B):
            for head in range(H_KV):
                valid = kept[row, head][kept[row, head] >= 0]
                assert valid.size == min(budget, lengths[row])
                assert np.all(np.diff(valid) > 0)
                recent = np.arange(max(lengths[row] - spec.window_for(budget), 0), lengths[row])
                assert set(recent) <= set(valid)


def test_streaming_llm_keeps_sinks_and_the_most_recent_tokens():
    """Any chunking: positions 0..3 (sinks) and the last budget - 4 of each row."""
    length, budget = 30, 10
    q, k, v = random_kv(4, length)
    positions = ragged_positions(length, (30, 21))
    cache = layer_cache(EvictionSpec("streaming_llm", budget=budget))
    for start, end in chunks(length, seed=5):
        sl = slice(start, end)
        cache, _ = attend(cache, 0, q[:, :, sl], k[:, :, sl], v[:, :, sl], positions[:, sl])
    kept = np.asarray(cache.layer(0).slot_positions)
    for row, n in enumerate((30, 21)):
        want = [0, 1, 2, 3, *range(n - (budget - 4), n)]
        for head in range(H_KV):
            np.testing.assert_array_equal(kept[row, head], want)


def test_h2o_scores_are_the_accumulated_attention_mass():
    """No eviction yet (budget holds all): each slot's score is the attention probability it got
    from every query so far, summed over the query heads of its K/V head."""
    length = 12
    q, k, v = random_kv(6, length)
    positions = ragged_positions(length, (12, 12))
    cache = layer_cache(EvictionSpec("h2o", budget=16, window=2))
    for start, end in ((0, 5), (5, 6), (6, 9), (9, 12)):
        sl = slice(start, end)
        cache, _ = attend(cache, 0, q[:, :, sl], k[:, :, sl], v[:, :, sl], positions[:, sl])
    logits = np.einsum("bhtd,bhsd->bhts", np.asarray(q), np.repeat(np.asarray(k), GROUP, axis=1)) / np.sqrt(D)
    logits = np.where(np.tril(np.ones((length, length), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    mass = probs.sum(axis=2).reshape(B, H_KV, GROUP, length).sum(axis=2)  # [B, H_kv, S]
    layer = cache.layer(0)
    np.testing.assert_array_equal(layer.slot_positions[..., :length], np.broadcast_to(np.arange(length), mass.shape))
    np.testing.assert_allclose(layer.scores[..., :length], mass, atol=1e-5)


def test_snapkv_scores_are_the_pooled_observation_window_mass():
    """One prefill of 16 tokens, window 4, kernel 3: the score of each key before the window is
    the window queries' mean attention, average-pooled (zero padded) and averaged over the query
    heads of its K/V head; the window's own keys are left out of the pooling (kvpress)."""
    length, window, kernel = 16, 4, 3
    q, k, v = random_kv(7, length)
    positions = ragged_positions(length, (16, 16))
    cache = layer_cache(EvictionSpec("snapkv", budget=20, window=window, kernel_size=kernel))
    cache, _ = attend(cache, 0, q, k, v, positions)
    logits = np.einsum("bhtd,bhsd->bhts", np.asarray(q), np.repeat(np.asarray(k), GROUP, axis=1)) / np.sqrt(D)
    logits = np.where(np.tril(np.ones((length, length), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    observed = probs[:, :, -window:, : length - window].mean(axis=2)  # [B, H_q, S - window]
    padded = np.pad(observed, ((0, 0), (0, 0), (kernel // 2, kernel // 2)))
    pooled = sum(padded[..., i : i + length - window] for i in range(kernel)) / kernel
    want = pooled.reshape(B, H_KV, GROUP, -1).mean(axis=2)
    np.testing.assert_allclose(cache.layer(0).scores[..., : length - window], want, atol=1e-6)


def test_key_norm_scores_and_keeps_the_lowest_norm_keys():
    length, budget = 12, 5
    q, k, v = random_kv(8, length)
    positions = ragged_positions(length, (12, 12))
    cache, _ = attend(layer_cache(EvictionSpec("key_norm", budget=budget)), 0, q, k, v, positions)
    norms = np.linalg.norm(np.asarray(k), axis=-1)
    want = np.sort(np.argsort(norms, axis=-1, kind="stable")[..., :budget], axis=-1)
    np.testing.assert_array_equal(cache.layer(0).slot_positions, want)
    np.testing.assert_allclose(cache.layer(0).scores, -np.take_along_axis(norms, want, axis=-1), rtol=1e-6)


@pytest.mark.parametrize("num_layers", [3, 4])  # odd: the middle entry is paired with itself
def test_pyramidkv_holds_its_mean_budget_and_equals_one_cache_per_layer_budget(num_layers):
    """PyramidKV's budgets fall with depth and average the budget. The stack pairs entries j and
    L-1-j, so it holds the mean budget per layer (what SnapKV at that budget holds), not the first
    layer's. Fed different K/V per layer, a prefill then random short chunks, ragged rows, under jit
    (the layer index traced, as a scanned model passes it), each layer gives the outputs, and keeps
    the positions, K/V and scores, of a one-layer SnapKV cache at its budget."""
    spec = EvictionSpec("pyramidkv", budget=40, window=2, beta=4, kernel_size=3)
    budgets = spec.resolved(64).layer_budgets(num_layers)  # the first layer capped at 64 - 2 (kvpress's)
    assert budgets[0] == 62 and budgets == sorted(budgets, reverse=True) and 40 > budgets[-1]
    assert abs(np.mean(budgets) - 40) <= 1
    cache = layer_cache(spec, num_layers=num_layers)
    snapkv = dataclasses.replace(spec, policy="snapkv")
    assert cache.groups[0].keys.shape[3] == 40 and cache.nbytes == layer_cache(snapkv, num_layers=num_layers).nbytes
    unstacked = Cache.from_layer_types(
        ["full_attention"] * num_layers, batch_size=B, num_kv_heads=H_KV, head_dim=D, max_length=64, eviction=spec
    )  # one group per layer: each holds exactly its budget, unpaired
    assert [group.keys.shape[3] for group in unstacked.groups] == budgets
    assert not any(group.paired for group in unstacked.groups)
    references = [layer_cache(dataclasses.replace(snapkv, budget=budget)) for budget in budgets]
    row_lengths = (90, 71)
    # A prefill (more than SnapKV's window: every slot rescored), then updates of random short
    # lengths; the layer index traced, so one compile per length and cache shape.
    bounds, rng = [0, 50], np.random.default_rng(num_layers)
    while bounds[-1] < max(row_lengths):
        bounds.append(min(max(row_lengths), bounds[-1] + int(rng.choice([1, 3]))))
    attend_at = jax.jit(cached_attention)
    layer_kv = [[np.asarray(x) for x in random_kv(100 * i, max(row_lengths))] for i in range(num_layers)]
    for start, end in zip(bounds, bounds[1:]):
        t = jnp.arange(start, end)[None, :]
        positions = jnp.where(t < jnp.asarray(row_lengths)[:, None], t, -1).astype(jnp.int32)
        for i, sequences in enumerate(layer_kv):
            q, k, v = (x[:, :, start:end] for x in sequences)
            cache, out = attend_at(cache, jnp.int32(i), q, k, v, positions)
            references[i], want = attend_at(references[i], jnp.int32(0), q, k, v, positions)
            np.testing.assert_allclose(out, want, atol=1e-5)
    cache, references = jax.device_get((cache, references))  # inspected layer by layer on the host
    for i, reference in enumerate(references):
        got, want = cache.layer(i), reference.layer(0)
        assert got.keys.shape[2] == budgets[i]
        np.testing.assert_array_equal(got.slot_positions, want.slot_positions)
        held = np.asarray(want.slot_positions >= 0)
        assert held[0].sum(-1).tolist() == [budgets[i]] * H_KV
        for name in ("keys", "values", "scores"):
            np.testing.assert_allclose(
                np.asarray(getattr(got, name))[held], np.asarray(getattr(want, name))[held], atol=1e-5
            )
        np.testing.assert_array_equal(got.lengths, row_lengths)


def test_pyramidkv_budgets_follow_the_prompt_length_of_the_cache():
    """kvpress's schedule for SmolLM2's 30 layers (``tests/eviction/test_eviction_parity.py`` compares it with
    kvpress at every depth): the first layer capped at the prompt minus the window, the last raised
    by as much, the mean kept, no layer over the prompt. The prompt length is the cache's
    ``max_length`` unless the spec names one; with neither (a cache that grows), no cap."""
    half = EvictionSpec("pyramidkv", compression_ratio=0.5).resolved(320)
    assert half.prompt_length == 320
    budgets = half.layer_budgets(30)
    assert (budgets[0], budgets[15], budgets[-1]) == (256, 157, 64) and abs(np.mean(budgets) - 160) < 0.5
    budgets = EvictionSpec("pyramidkv", compression_ratio=0.25).resolved(2048).layer_budgets(30)
    assert (budgets[0], budgets[15], budgets[-1]) == (1984, 1521, 1088)
    named = EvictionSpec("pyramidkv", budget=160, prompt_length=320).resolved(4096)
    assert named.layer_budgets(30) == EvictionSpec("pyramidkv", budget=160).resolved(320).layer_budgets(30)
    unbounded = EvictionSpec("pyramidkv", budget=2048).resolved(None).layer_budgets(30)
    assert (unbounded[0], unbounded[-1]) == (3994, 102) and max(half.resolved(None).layer_budgets(30)) == 256
    with pytest.raises(ValueError, match="fraction of max_length: pass max_length"):
        EvictionSpec("pyramidkv", compression_ratio=0.5).resolved(None)
    with pytest.raises(ValueError, match="resolve the compression ratio first"):
        EvictionSpec("pyramidkv", compression_ratio=0.5).layer_budgets(30)


# --- decoding strategies ---------------------------------------------------------------------
def test_generate_and_beam_search_run_with_eviction(model):
    """A budget below the sequence: generate and beam search run under jit; the cache holds the
    budget; beams reorder whole rows (a beam's kept positions follow it)."""
    spec = EvictionSpec("h2o", budget=8, window=4)
    prompts = [[3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7], [35, 8, 9]]
    result = generate(model, prompts, max_new_tokens=6, eviction=spec)
    assert np.asarray(result.tokens).shape == (2, 6)
    kept = np.asarray(result.cache.layer(0).slot_positions)
    assert np.all((kept >= 0).sum(-1) <= 8)
    beams = beam_search(model, prompts, num_beams=3, num_return_sequences=3, max_new_tokens=5, eviction=spec)
    assert beams.tokens.shape == (2, 3, 5) and np.all(beams.lengths > 0)


def test_rollback_and_speculative_decoding_refuse_eviction(model):
    cache = layer_cache(EvictionSpec("snapkv", budget=8, window=2))
    q, k, v = random_kv(10, 6)
    cache, _ = attend(cache, 0, q, k, v, ragged_positions(6, (6, 6)))
    with pytest.raises(ValueError, match="evicting layer cannot undo tokens"):
        cache.rollback(1)
    assert cache.rollback(0).lengths.tolist() == [6, 6]
    empty = cache.reset().layer(0)
    assert np.all(empty.slot_positions == -1) and np.all(empty.lengths == 0) and np.all(empty.budget == 8)
    # Under jit the count is clamped to what the layer can undo: nothing.
    np.testing.assert_array_equal(jax.jit(lambda c: c.rollback(2))(cache).lengths, [6, 6])
    with pytest.raises(ValueError, match="can undo 0 tokens"):
        generate_speculative(model, [[1, 2, 3]], drafter=PromptLookup(), max_new_tokens=4, num_draft_tokens=2,
                             eviction=EvictionSpec("h2o", budget=8, window=4))  # fmt: skip


# --- errors and footprint --------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(policy="lru", budget=8), "unknown policy 'lru'"),
        (dict(policy="h2o"), "exactly one of budget"),
        (dict(policy="h2o", budget=8, compression_ratio=0.5), "exactly one of budget"),
        (dict(policy="h2o", compression_ratio=1.0), r"compression_ratio must be in \[0, 1\)"),
        (dict(policy="snapkv", budget=8, kernel_size=4), "kernel_size must be a positive odd"),
        (dict(policy="h2o", budget=0), "budget must be at least 1"),
        (dict(policy="snapkv", budget=8, prompt_length=64), "prompt_length plans PyramidKV's per-layer budgets"),
        (dict(policy="pyramidkv", budget=8, prompt_length=0), "prompt_length must be at least 1 token"),
    ],
)
def test_spec_errors_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EvictionSpec(**kwargs)


def test_build_errors_name_the_fix():
    with pytest.raises(ValueError, match="a window of 64 recent tokens are always kept but the budget is 16"):
        layer_cache(EvictionSpec("snapkv", budget=16))
    with pytest.raises(ValueError, match="does not combine with quantization"):
        Cache.from_layer_types(["full_attention"], batch_size=1, num_kv_heads=1, head_dim=8, max_length=16,
                               eviction=EvictionSpec("h2o", budget=8), quantization=QuantSpec(nbits=8))  # fmt: skip
    with pytest.raises(ValueError, match="fraction of max_length"):
        ratio = EvictionSpec("h2o", compression_ratio=0.5)
        Cache.from_layer_types(["full_attention"], batch_size=1, num_kv_heads=1, head_dim=8, eviction=ratio)
    cache = layer_cache(EvictionSpec("h2o", budget=8))
    with pytest.raises(TypeError, match="cached_attention"):
        cache.update(0, jnp.zeros((B, H_KV, 1, D)), jnp.zeros((B, H_KV, 1, D)))


def test_compression_ratio_keeps_kvpress_count_and_bytes_follow_the_formula():
    cache = layer_cache(EvictionSpec("h2o", compression_ratio=0.75), max_length=50)
    layer = cache.layer(0)
    assert layer.keys.shape[2] == int(50 * 0.25) and layer.spec.window_for(12) == 6
    assert layer.nbytes == EvictingLayer.kv_bytes(B, 50, H_KV, D, jnp.float32, slots=12)
    assert ("full_attention", "evicted", EvictingLayer) in storage_rows()


def test_attention_slot_mass_sums_to_the_weighted_queries():
    """``attention(..., query_weights=w)`` returns, per K/V head, probabilities summed over its
    query heads and weighted queries: GROUP * sum(w) per row, padding queries contributing none."""
    q, k, v = random_kv(11, 5)
    positions = ragged_positions(5, (5, 3))
    cache, view = layer_cache(None).update(0, k, v, positions)
    weights = jnp.asarray([[1, 1, 0.5, 0, 2], [1, 1, 1, 1, 1]], jnp.float32)
    out, mass = attention(q, view, positions, query_weights=weights)
    np.testing.assert_allclose(mass.sum(-1), [[GROUP * 4.5] * H_KV, [GROUP * 3.0] * H_KV], rtol=1e-6)
    np.testing.assert_array_equal(out, attention(q, view, positions))


def test_gemma3_evicts_its_full_layers_and_keeps_its_sliding_rings():
    """Gemma 3's pattern (tiny: sliding, full): eviction applies to the full-attention layer; the
    sliding layer keeps its ring. A budget holding everything gives the full cache's tokens."""
    gemma = Gemma3(Gemma3Config(**TINY_GEMMA), seed=0)
    cache = gemma.init_cache(1, 32, eviction=EvictionSpec("snapkv", budget=6, window=2, kernel_size=3))
    assert [type(layer) for layer in cache.layers] == [SlidingWindowLayer, EvictingLayer]
    prompts = [[3, 14, 15, 9, 2, 6, 5, 3, 5]]
    want = generate(gemma, prompts, max_new_tokens=6).tokens
    spec = EvictionSpec("snapkv", budget=24, window=2, kernel_size=3)
    np.testing.assert_array_equal(generate(gemma, prompts, max_new_tokens=6, eviction=spec).tokens, want)
    with pytest.raises(ValueError, match="hybrid layer"):
        linear = dict(conv_width=2, conv_channels=4, state_shapes=((2, 2),))
        Cache.from_layer_types(["hybrid"], batch_size=1, num_kv_heads=1, head_dim=8, max_length=8, **linear,
                               eviction=EvictionSpec("h2o", budget=4))  # fmt: skip


# --- one prefill, many budgets (Cache.evict) ---------------------------------------------------
SWEEP_SPECS = {
    "streaming_llm": EvictionSpec("streaming_llm", budget=8, sinks=2),
    "snapkv": EvictionSpec("snapkv", budget=8, window=3, kernel_size=3),
    "pyramidkv": EvictionSpec("pyramidkv", budget=8, window=2, kernel_size=3, beta=2),
    "h2o": EvictionSpec("h2o", budget=8, window=3),
    "key_norm": EvictionSpec("key_norm", budget=8),
}
SWEEP_PROMPTS = [
    [3, 14, 15, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2],
    [35, 8, 9, 7, 9, 3, 23, 8, 4, 6, 26, 4, 3],
]


@pytest.mark.parametrize("policy", POLICIES)
def test_evicting_an_observed_prefill_equals_prefilling_at_the_budget(model, policy):
    """Ragged prompts prefilled once into the policy's observer (32 slots, nothing evicted), then
    cut to 8 slots (PyramidKV: 12 down to 4 by depth) by ``Cache.evict``, eagerly and under jit:
    every layer holds the positions a prefill at that budget keeps, with its K/V and scores, and
    greedy decoding from both gives the same tokens."""
    from jaxkv.decoding.generate import prefill_prefix

    spec = SWEEP_SPECS[policy]
    direct = prefill_prefix(model, SWEEP_PROMPTS, max_length=32, eviction=spec)
    observed = prefill_prefix(model, SWEEP_PROMPTS, max_length=32, eviction=spec.observer(32))
    assert np.all(np.asarray(observed.layer(0).slot_positions >= 0).sum(-1).T == [20, 13])  # all held
    for evicted in (observed.evict(spec), jax.jit(lambda c: c.evict(spec))(observed)):
        chex.assert_trees_all_equal_shapes_and_dtypes(evicted, direct)
        # Layer by layer on the host (indexing device arrays eagerly compiles a slice per layer).
        for got, want in zip(jax.device_get(evicted).layers, jax.device_get(direct).layers):
            np.testing.assert_array_equal(got.slot_positions, want.slot_positions)
            np.testing.assert_array_equal(got.budget, want.budget)
            chex.assert_trees_all_close((got.keys, got.values, got.scores, got.lengths),
                                        (want.keys, want.values, want.scores, want.lengths), atol=1e-6)  # fmt: skip
    questions = [[4, 5, 6], [7, 8]]
    want = generate(model, questions, max_new_tokens=6, cache=direct).tokens
    np.testing.assert_array_equal(generate(model, questions, max_new_tokens=6, cache=observed.evict(spec)).tokens, want)


def test_evict_keeps_sliding_rings_and_names_what_it_cannot_do(model):
    """Gemma 3's sliding ring is left as it is; a policy scoring otherwise, more slots than held,
    and a cache without evicting layers are errors naming the fix."""
    gemma = Gemma3(Gemma3Config(**TINY_GEMMA), seed=0)
    spec = EvictionSpec("h2o", budget=6, window=2)
    observed = gemma.init_cache(1, 32, eviction=spec.observer(32))
    evicted = observed.evict(spec)
    assert evicted.groups[0] is observed.groups[0] and evicted.layer(1).keys.shape[2] == 6
    with pytest.raises(ValueError, match="prefill with 'snapkv''s EvictionSpec.observer"):
        observed.evict(EvictionSpec("snapkv", budget=6, window=2))
    with pytest.raises(ValueError, match="cannot evict to 40 slots: this layer holds 32"):
        observed.evict(EvictionSpec("h2o", budget=40))
    with pytest.raises(ValueError, match="no evicting layers"):
        model.init_cache(1, 32).evict(spec)
    assert EvictionSpec("pyramidkv", budget=8).observer(32) == EvictionSpec("snapkv", budget=32)
