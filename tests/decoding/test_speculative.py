"""Speculative decoding (jaxkv.decoding.speculative): greedy output equals plain greedy decoding for
every cache type and every drafter, the sampling rule keeps the target's distribution, and
prompt lookup finds what it should.

Tiny random models: Llama with static, dynamic, sliding-window (window 4, far shorter than
the sequences) and chunked (chunk 8) caches, and a Gemma 3 with a sliding (window 4) and a
full layer. Prompts repeat a phrase so prompt lookup has something to copy; batches are
ragged, rows stop on a stop token or at max_new_tokens, so rows accept different counts
and roll back by different amounts in the same round. The real Gemma 3 270M past its
window: test_speculative_gemma3.py (real weights, compiled with full optimization).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from jaxkv.cache import Cache
from jaxkv.decoding.generate import Finish, generate
from jaxkv.decoding.sampling import Sampling
from jaxkv.quantization import PER_CHANNEL, QuantSpec
from jaxkv.decoding.speculative import (
    DraftModel,
    PromptLookup,
    SelfSpeculation,
    generate_speculative,
    lookup_drafts,
    verify,
)
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig
from tests.cases import TINY_GEMMA, TINY_LLAMA, VOCAB

LLAMA, GEMMA = TINY_LLAMA, TINY_GEMMA

# name -> (target, cache settings for generate)
SETUPS = {
    "llama-static": (lambda: Llama(LlamaConfig(**LLAMA)), {}),
    "llama-dynamic": (lambda: Llama(LlamaConfig(**LLAMA)), {"full_attention": "dynamic"}),
    "llama-sliding": (lambda: Llama(LlamaConfig(**LLAMA, sliding_window=4)), {}),
    "llama-chunked": (
        lambda: Llama(LlamaConfig(**LLAMA, layer_types=("chunked_attention",) * 3)),
        {"attention_chunk_size": 8},
    ),
    "gemma3-static": (lambda: Gemma3(Gemma3Config(**GEMMA)), {}),
    "gemma3-dynamic": (lambda: Gemma3(Gemma3Config(**GEMMA)), {"full_attention": "dynamic"}),
}


DRAFTERS = {
    "prompt_lookup": lambda: PromptLookup(),
    "draft_model": lambda: DraftModel(Llama(LlamaConfig(**LLAMA | {"num_hidden_layers": 1}), seed=1)),
    "self": lambda: SelfSpeculation(exit_layer=1),  # the target's first layer drafts
}
# Every cache type with prompt lookup; the model drafters (whose caches roll back too) and
# draft counts k spread over them to keep the compiles few.
CASES = [
    ("llama-static", "prompt_lookup", 4), ("llama-static", "self", 1),
    ("llama-dynamic", "prompt_lookup", 3), ("llama-dynamic", "self", 2),
    ("llama-sliding", "prompt_lookup", 4), ("llama-sliding", "draft_model", 3),
    ("llama-chunked", "prompt_lookup", 2), ("llama-chunked", "self", 4),
    ("gemma3-static", "prompt_lookup", 4), ("gemma3-static", "draft_model", 2),
    ("gemma3-dynamic", "prompt_lookup", 3), ("gemma3-dynamic", "self", 3),
]  # fmt: skip


def repetitive_prompts(seed: int) -> list[list[int]]:
    """Two ragged prompts that repeat a phrase (something for prompt lookup to copy)."""
    rng = np.random.default_rng(seed)
    phrase = rng.integers(0, VOCAB, 5).tolist()
    return [phrase * 3 + rng.integers(0, VOCAB, 4).tolist(), rng.integers(0, VOCAB, 3).tolist() + phrase]


@functools.cache
def plain_greedy(setup: str):
    """The target, its cache settings, the prompts, a stop token and plain greedy's result.

    The stop token is one row 0 produces mid-way, so row 0 stops early while row 1 runs on
    (or stops elsewhere)."""
    build, cache_settings = SETUPS[setup]
    target, prompts = build(), repetitive_prompts(0)
    stop = [generate(target, prompts, max_new_tokens=40, **cache_settings).row(0)[17]]
    plain = generate(target, prompts, max_new_tokens=40, stop_tokens=stop, **cache_settings)
    assert plain.finish[0] == Finish.STOP_TOKEN
    return target, cache_settings, prompts, stop, plain


@pytest.mark.parametrize("setup, drafter, k", CASES)
def test_greedy_equals_plain_greedy_for_every_cache_and_drafter(setup, drafter, k):
    target, cache_settings, prompts, stop, plain = plain_greedy(setup)
    result = generate_speculative(
        target, prompts, drafter=DRAFTERS[drafter](), num_draft_tokens=k, max_new_tokens=40, stop_tokens=stop,
        **cache_settings,
    )  # fmt: skip
    for row in range(len(prompts)):
        assert result.row(row) == plain.row(row), f"row {row}"
    assert result.finish == plain.finish
    chex.assert_trees_all_equal(result.tokens, plain.tokens)
    assert 1 <= result.tokens_per_step <= k + 1
    # A round keeps 1 to k + 1 tokens, so a row takes at least ceil((n - 1) / (k + 1)) rounds and at most n - 1.
    assert np.all(result.target_steps >= -(-(result.num_generated - 1) // (k + 1)))
    assert np.all(result.target_steps <= result.num_generated - 1)
    assert np.all(np.asarray(result.cache.lengths) == np.array([len(p) for p in prompts]) + result.num_generated - 1)


# Quantized caches with small groups and residuals (R = 8 or 4: the 60-odd tokens of a row
# cross many flushes). Without the exact-chunk limit, int4 and int2 already diverge from
# plain greedy within these 40 tokens.
QUANTIZED_CASES = {
    "int8": (QuantSpec(nbits=8, q_group_size=4, residual_length=8), "llama-static", "target_as_draft", 4),
    "int4": (QuantSpec(nbits=4, q_group_size=4, residual_length=8), "llama-static", "self", 3),
    "int4-kivi": (
        QuantSpec(nbits=4, axis_key=PER_CHANNEL, q_group_size=4, residual_length=8), "llama-static", "prompt_lookup", 4
    ),
    "int2": (QuantSpec(nbits=2, q_group_size=4, residual_length=4), "llama-static", "prompt_lookup", 3),
    "e4m3": (QuantSpec(format="e4m3", q_group_size=8, residual_length=8), "llama-static", "self", 4),
    "e5m2-kivi": (
        QuantSpec(format="e5m2", axis_key=PER_CHANNEL, q_group_size=4, residual_length=8), "gemma3-static",
        "prompt_lookup", 3,
    ),
    "int4-no-residual": (QuantSpec(nbits=4, q_group_size=4, residual_length=0), "llama-static", "prompt_lookup", 4),
    "int4-kivi-sliding": (
        QuantSpec(nbits=4, axis_key=PER_CHANNEL, q_group_size=4, residual_length=4), "llama-sliding", "prompt_lookup",
        4,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", QUANTIZED_CASES)
def test_greedy_equals_plain_greedy_with_quantized_caches(name):
    """Every quantized format, both KIVI axes, with and without a residual, full and
    sliding layers: the verification stops at the next flush (``exact_chunk_lengths``), so
    each query sees the keys in the form plain decoding showed it."""
    spec, setup, drafter, k = QUANTIZED_CASES[name]
    build, cache_settings = SETUPS[setup]
    target, prompts = build(), repetitive_prompts(2)
    # The target as its own draft model: a quantized draft cache that accepts and rolls back.
    drafter = DraftModel(target) if drafter == "target_as_draft" else DRAFTERS[drafter]()
    cache_settings = cache_settings | {"quantization": spec}
    plain = generate(target, prompts, max_new_tokens=40, **cache_settings)
    result = generate_speculative(
        target, prompts, drafter=drafter, num_draft_tokens=k, max_new_tokens=40, **cache_settings
    )
    assert [result.row(0), result.row(1)] == [plain.row(0), plain.row(1)]
    assert result.finish == plain.finish
    assert result.tokens_per_step > 1  # drafts were accepted, across flushes too


def test_verification_stops_at_the_next_flush():
    """``Cache.exact_chunk_lengths``: R - L mod R per row, the minimum over layers; None
    without quantized layers or with R = 0."""
    config = LlamaConfig(**LLAMA)
    spec = QuantSpec(nbits=4, q_group_size=4, residual_length=8)
    cache = Cache.from_config(config, 3, max_length=32, quantization=spec)
    assert np.asarray(cache.exact_chunk_lengths()).tolist() == [8, 8, 8]
    keys = jnp.ones((3, 2, 9, 8))
    positions = jnp.asarray([list(range(9)), list(range(8)) + [-1], list(range(3)) + [-1] * 6])
    for layer in range(3):
        cache, _ = cache.update(layer, keys, keys, positions)
    assert np.asarray(cache.exact_chunk_lengths()).tolist() == [7, 8, 5]
    assert Cache.from_config(config, 1, max_length=8).exact_chunk_lengths() is None
    no_residual = QuantSpec(nbits=4, q_group_size=4, residual_length=0)
    assert Cache.from_config(config, 1, max_length=8, quantization=no_residual).exact_chunk_lengths() is None


def test_identical_draft_model_accepts_everything_and_rows_stop_at_capacity():
    """A draft model equal to the target accepts all k drafts (the 'bonus token' path, and
    the draft cache's pending token); a small static capacity stops rows with CAPACITY
    exactly where plain decoding does, although verification writes past it."""
    target = Llama(LlamaConfig(**LLAMA))
    prompts = repetitive_prompts(1)
    plain = generate(target, prompts, max_new_tokens=60, max_length=32)
    assert plain.finish == [Finish.CAPACITY, Finish.CAPACITY]
    result = generate_speculative(
        target, prompts, drafter=DraftModel(target), num_draft_tokens=3, max_new_tokens=60, max_length=32
    )
    assert [result.row(0), result.row(1)] == [plain.row(0), plain.row(1)]
    assert result.finish == plain.finish
    assert result.acceptance_rate == 1.0
    assert np.asarray(result.cache.lengths).tolist() == [32, 32]


# One compile per draft count: histories are padded to one width.
lookup = jax.jit(lookup_drafts, static_argnums=(2, 3, 4))


@given(st.lists(st.integers(0, 4), min_size=1, max_size=24), st.integers(1, 6))
def test_lookup_drafts_copy_what_followed_the_latest_match(history, num_draft):
    """Against a direct Python search: the longest n-gram (3, 2, 1) of the tail that occurs
    earlier, its latest occurrence, and the tokens after it (the repeating span continued
    where they are not generated yet)."""
    padded = jnp.asarray([history + [0] * (32 - len(history))], jnp.int32)
    got = np.asarray(lookup(padded, jnp.asarray([len(history)]), num_draft, 3, 1))[0].tolist()
    want = [history[-1]] * num_draft
    for n in (3, 2, 1):
        starts = [s for s in range(len(history) - n) if history[s : s + n] == history[len(history) - n :]]
        if starts:
            extended = list(history)
            s = starts[-1]
            while len(extended) < s + n + num_draft:  # the text continues the repeating span
                extended.append(extended[len(extended) - (len(history) - n - s)])
            want = extended[s + n : s + n + num_draft]
            break
    assert got == want


def test_lookup_drafts_examples():
    history = jnp.asarray([[1, 2, 3, 9, 8, 1, 2, 3, 0, 0], [5, 6, 7, 5, 6, 7, 0, 0, 0, 0]], jnp.int32)
    chex.assert_trees_all_equal(
        lookup(history, jnp.asarray([8, 6]), 5, 3, 1),
        jnp.asarray([[9, 8, 1, 2, 3], [5, 6, 7, 5, 6]], jnp.int32),
    )


def _first_token_distribution(target_logits, draft_logits, drafts_from_q, sampling, num_samples=20_000):
    """Empirical distribution of the first kept token over ``num_samples`` verifications
    of one row (k = 1): the draft drawn from q, then ``verify``."""
    vocab = target_logits.shape[-1]

    def one(key):
        draft_key, verify_key = jax.random.split(key)
        draft = drafts_from_q(draft_key)
        logits = None if draft_logits is None else draft_logits[None, None]
        _, tokens = verify(target_logits[None, None].repeat(2, axis=1), draft[None, None], logits, verify_key, sampling)
        return tokens[0, 0]

    tokens = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), num_samples))
    return np.bincount(np.asarray(tokens), minlength=vocab) / num_samples


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=4)])
def test_acceptance_rule_keeps_the_target_distribution(sampling):
    """min(1, p/q) acceptance plus norm(max(0, p - q)) resampling gives exactly p, for a
    draft model's q and for prompt lookup's one-hot q, with the sampling filters applied."""
    from jaxkv.decoding.sampling import sampling_logits

    rng = np.random.default_rng(0)
    target_logits = jnp.asarray(rng.normal(size=6) * 1.5, jnp.float32)
    draft_logits = jnp.asarray(rng.normal(size=6) * 1.5, jnp.float32)
    p = np.asarray(jax.nn.softmax(sampling_logits(target_logits[None], sampling)[0]))
    q_logits = sampling_logits(draft_logits[None], sampling)[0]
    from_draft_model = _first_token_distribution(
        target_logits, draft_logits, lambda key: jax.random.categorical(key, q_logits), sampling
    )
    from_lookup = _first_token_distribution(target_logits, None, lambda key: jnp.int32(2), sampling)
    q = np.asarray(jax.nn.softmax(q_logits))
    assert 0.5 * np.abs(p - q).sum() > 0.1  # the drafter really is wrong, so the rule must correct it
    np.testing.assert_allclose(from_draft_model, p, atol=0.012)  # 3.4 standard deviations at most
    np.testing.assert_allclose(from_lookup, p, atol=0.012)


def test_sampled_generation_follows_the_target_distribution():
    """End to end on a tiny model (vocabulary 5): the first three sampled tokens of 4000
    identical rows, decoded speculatively with a different draft model, are distributed
    as the target's joint p(t1) p(t2 | t1) p(t3 | t1, t2) (computed exactly)."""
    tiny = LLAMA | {"vocab_size": 5}
    target = Llama(LlamaConfig(**tiny), seed=3)
    draft_model = Llama(LlamaConfig(**tiny | {"num_hidden_layers": 1}), seed=4)
    for model in (target, draft_model):  # a random init's logits are nearly uniform: sharpen them, so q differs from p
        model.lm_head[...] *= 25
    draft = DraftModel(draft_model)
    prompt, rows = [1, 2, 3, 4], 4000
    result = generate_speculative(
        target, [prompt] * rows, drafter=draft, num_draft_tokens=2, max_new_tokens=3, sampling=Sampling(1.0), seed=5
    )
    observed = np.zeros((5, 5, 5))
    np.add.at(observed, tuple(result.tokens.T), 1 / rows)

    sequences = np.array([prompt + [a, b] for a in range(5) for b in range(5)], np.int32)
    cache = target.init_cache(len(sequences), 8)
    logits, _ = target(jnp.asarray(sequences), cache.next_positions(6), cache)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1)).reshape(5, 5, 6, 5)
    exact = probs[0, 0, 3][:, None, None] * probs[:, 0, 4][:, :, None] * probs[:, :, 5]
    assert result.acceptance_rate < 0.9  # drafts are rejected, so resampling is exercised
    # Total variation: 0.02 measured (plain sampling of as many rows: 0.018); the draft's own joint is 0.95 away.
    assert 0.5 * np.abs(observed - exact).sum() < 0.05


def test_bad_requests_name_the_fix():
    llama = Llama(LlamaConfig(**LLAMA))

    class NoEarlyExit(nnx.Module):  # a decoder that cannot run only its first layers
        config = llama.config

        def init_cache(self, batch_size, max_length=None, **cache_kwargs):
            return llama.init_cache(batch_size, max_length, **cache_kwargs)

        def __call__(self, tokens, positions, cache, logits_index=None):
            return llama(tokens, positions, cache, logits_index)

    with pytest.raises(TypeError, match="NoEarlyExit does not implement EarlyExitModel: missing early_exit; Self"):
        generate_speculative(NoEarlyExit(), [[1, 2]], drafter=SelfSpeculation(1), max_new_tokens=4)
    with pytest.raises(TypeError, match="object does not implement DecoderModel: missing __call__, config, init_cache"):
        generate_speculative(object(), [[1, 2]], drafter=PromptLookup(), max_new_tokens=4)
    with pytest.raises(ValueError, match="speculative decoding starts a decoder-only model from its prompts"):
        generate_speculative(llama, [[1, 2]], drafter=PromptLookup(), max_new_tokens=4, cache=llama.init_cache(1, 8))
    with pytest.raises(ValueError, match=r"exit_layer must be in \[1, 3\)"):
        generate_speculative(llama, [[1, 2]], drafter=SelfSpeculation(3), max_new_tokens=4)
    other_vocab = Llama(LlamaConfig(**LLAMA | {"vocab_size": VOCAB + 1}))
    with pytest.raises(ValueError, match="same tokenizer|target's tokenizer"):
        generate_speculative(llama, [[1, 2]], drafter=DraftModel(other_vocab), max_new_tokens=4)
    with pytest.raises(ValueError, match="num_draft_tokens must be at least 1"):
        generate_speculative(llama, [[1, 2]], drafter=PromptLookup(), num_draft_tokens=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)
