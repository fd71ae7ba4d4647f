"""One prefill for a grid of caches (``jaxkv.research.observer``): an ``Observer`` cache, refilled
into each eviction policy's cache at a budget, equals prefilling at that budget; into the plain
cache, the plain prefill; into a quantized one, the observed K/V in its codes. The oracle is the
direct prefill of each cache (``prefill_prefix``)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import Cache
from jaxkv.decoding.generate import generate, prefill_prefix
from jaxkv.eviction import POLICIES, EvictionSpec
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.quantization import QuantSpec
from jaxkv.research.observer import Observer, refill
from tests.cases import TINY_GEMMA, TINY_LLAMA
from tests.eviction.test_eviction import SWEEP_PROMPTS, SWEEP_SPECS


@pytest.fixture(scope="module")
def model():
    return Llama(LlamaConfig(**TINY_LLAMA), seed=0)


@pytest.mark.parametrize("policy", POLICIES)
def test_refilling_from_one_observed_prefill_equals_prefilling_at_the_budget(model, policy):
    """One prefill into an Observer cache (every token held, both attention scorings recorded)
    refilled into each policy's cache, under jit: every layer holds what a prefill at that budget
    keeps (positions, K/V, scores), and greedy decoding from both gives the same tokens."""
    spec = SWEEP_SPECS[policy]
    window = spec.observation_window or 5  # any window serves the other policies
    direct = prefill_prefix(model, SWEEP_PROMPTS, max_length=32, eviction=spec)
    observed = prefill_prefix(model, SWEEP_PROMPTS, max_length=32, layer_builder=Observer(window))
    refilled = jax.jit(refill)(observed, model.init_cache(2, 32, eviction=spec))
    chex.assert_trees_all_equal_shapes_and_dtypes(refilled, direct)
    for got, want in zip(refilled.layers, direct.layers):
        np.testing.assert_array_equal(got.slot_positions, want.slot_positions)
        chex.assert_trees_all_close((got.keys, got.values, got.scores, got.lengths),
                                    (want.keys, want.values, want.scores, want.lengths), atol=1e-5)  # fmt: skip
    questions = [[4, 5, 6], [7, 8]]
    want = generate(model, questions, max_new_tokens=6, cache=direct).tokens
    np.testing.assert_array_equal(generate(model, questions, max_new_tokens=6, cache=refilled).tokens, want)


def test_an_observed_prefill_refills_plain_rings_and_quantized_caches(model):
    """Gemma 3's sliding rings span the whole context in the observer and are cut to the window on
    refilling: the plain cache equals the plain prefill. A quantized cache stores the observed K/V
    (the next token's logits within int8's error of the plain cache's); the observer names what
    it cannot be combined with, a window it did not observe and a rollback."""
    gemma = Gemma3(Gemma3Config(**TINY_GEMMA), seed=0)
    observed = prefill_prefix(gemma, SWEEP_PROMPTS, max_length=32, layer_builder=Observer(3))
    assert observed.layer(0).keys.shape[2] == 32 and observed.layer(1).describe() == "observer window=3"
    plain = prefill_prefix(gemma, SWEEP_PROMPTS, max_length=32)
    chex.assert_trees_all_close(refill(observed, gemma.init_cache(2, 32)), plain, atol=1e-5)
    int8 = QuantSpec(nbits=8, q_group_size=8, residual_length=4)
    quantized = refill(observed, gemma.init_cache(2, 32, quantization=int8))
    tokens = jnp.asarray([[4], [7]], jnp.int32)
    want, _ = gemma(tokens, plain.next_positions(1), plain)
    got, _ = gemma(tokens, quantized.next_positions(1), quantized)
    error = float(jnp.max(jnp.abs(got - want)))
    assert 0 < error < 0.01 * float(jnp.max(jnp.abs(want))), error  # int8 codes, not the plain K/V
    assert generate(gemma, [[4, 5, 6], [7, 8]], max_new_tokens=4, cache=quantized).tokens.shape == (2, 4)
    with pytest.raises(ValueError, match="an Observer cache holds plain K/V"):
        gemma.init_cache(1, 32, layer_builder=Observer(), quantization=int8)
    with pytest.raises(ValueError, match=r"prefill with Observer\(window=2\)"):
        refill(observed, gemma.init_cache(2, 32, eviction=EvictionSpec("snapkv", budget=8, window=2)))
    with pytest.raises(TypeError, match="prefill into an Observer cache"):
        refill(model.init_cache(2, 32), model.init_cache(2, 32, eviction=EvictionSpec("h2o", budget=8)))
    with pytest.raises(ValueError, match="observer cannot undo"):
        observed.rollback(1)
    with pytest.raises(ValueError, match="layer types"):
        refill(observed, model.init_cache(2, 32))  # the Llama's


@pytest.mark.parametrize("layer_type", ["chunked_attention", "hybrid", "hybrid_sliding"])
def test_an_observer_refuses_the_layers_it_cannot_observe(layer_type):
    """Chunked and hybrid layers keep no full-attention K/V an observer could score: an error naming the type."""
    linear = dict(conv_width=2, conv_channels=4, state_shapes=((2, 2),))
    with pytest.raises(ValueError, match=f"an Observer covers full and sliding attention; {layer_type} layers"):
        Cache.from_layer_types(
            [layer_type], batch_size=1, num_kv_heads=1, head_dim=8, max_length=8, sliding_window=4,
            attention_chunk_size=4, layer_builder=Observer(), **linear,
        )  # fmt: skip


def test_an_observer_window_holds_a_query():
    with pytest.raises(ValueError, match="Observer: window must be at least 1 query, got 0"):
        Observer(0)


def test_a_prefill_in_chunks_observes_what_one_update_does(model):
    """``prefill_prefix(chunk=16)`` (updates of 16 tokens, the last one at least 16, so it brings
    the window whole; ragged rows) leaves the observer cache one update leaves: K/V, lengths, both
    masses (the experiment runner prefills its contexts so)."""
    rng = np.random.default_rng(0)
    contexts = [rng.integers(0, 60, 61).tolist(), rng.integers(0, 60, 50).tolist()]
    chunked = prefill_prefix(model, contexts, max_length=64, chunk=16, layer_builder=Observer(5))
    whole = prefill_prefix(model, contexts, max_length=64, layer_builder=Observer(5))
    chex.assert_trees_all_close(chunked, whole, atol=1e-5)
    with pytest.raises(ValueError, match="chunk must be a positive number of tokens, got 0"):
        prefill_prefix(model, contexts, max_length=64, chunk=0)
