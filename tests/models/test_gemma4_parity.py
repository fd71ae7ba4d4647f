"""Gemma 4 (text) logits and greedy tokens equal transformers', on tiny random weights.

A tiny config with everything Gemma 4 adds to Gemma 3 is built and saved by transformers
(safetensors) and loaded through our checkpoint loader: K/V shared across layers (the last 3 of
7 layers reuse the last storing sliding and full layers' K/V and have double-wide MLPs),
full-attention layers with their own head dim, K/V head count and proportional RoPE, taking
their keys' projection as values (``attention_k_eq_v``), per-layer embeddings, a mixture of 4
experts (top 2) beside every MLP, a final soft-cap and random norms (no released Gemma 4 has all
of them at once; transformers runs them together). A ragged batch runs a prefill, then 32 single-token decode
steps fed the same (teacher-forced) tokens: every step's logits match transformers'
full-sequence logits within 1e-4 (float32), with static and dynamic caches; the jitted
``generate`` reproduces transformers' greedy tokens for 32 steps with both; the serving engine
(pages for the storing layers only, staggered arrivals, a prefix-cache hit) gives each request
``generate``'s tokens.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from jaxkv.models.gemma4 import Gemma4, Gemma4Config
from jaxkv.models.weights import load_safetensors_checkpoint

from jaxkv.decoding.generate import generate
from jaxkv.serving import Engine
from tests.cases import greedy_reference, run_arrivals
from tests.parity import check_teacher_forced, hf_early_exit_logits, hf_greedy, save_tiny_hf_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SLIDING, FULL = "sliding_attention", "full_attention"
SMALL = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=4, max_position_embeddings=256,
    layer_types=[SLIDING, SLIDING, FULL] * 2 + [FULL], num_kv_shared_layers=3, use_double_wide_mlp=True,
    hidden_size_per_layer_input=8, vocab_size_per_layer_input=101, final_logit_softcapping=30.0,
    attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True, num_experts=4, top_k_experts=2,
    moe_intermediate_size=24,
    rope_parameters={
        SLIDING: {"rope_type": "default", "rope_theta": 100.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 5000.0},
    },
)  # fmt: skip
PROMPTS = [17, 6]  # ragged rows
DECODE_STEPS = 32
EXIT_LAYERS, EXIT_STEPS = 5, 4  # early exit after layer 4, the first reusing K/V: a prefill and 4 steps


@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef, state, tokens, positions, cache):
    """One compiled model call."""
    return nnx.merge(graphdef, state)(tokens, positions, cache)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma4")
    hf_config = transformers.Gemma4TextConfig(**SMALL)
    sequences, expected, hf = save_tiny_hf_model(
        hf_config, directory, SMALL["vocab_size"], PROMPTS, DECODE_STEPS, perturb_norms=True,
        attn_implementation="eager",
    )  # fmt: skip
    config, params = load_safetensors_checkpoint(directory)
    return hf_config, config, Gemma4(config, params), sequences, expected, hf


def test_config_reads_transformers_names(checkpoint):
    """The sharing, the full layers' head dim and the cache built from them: no storage for the
    reusing layers, each layer type at its own head shape."""
    hf_config, config, model, *_ = checkpoint
    assert isinstance(config, Gemma4Config)
    assert hf_config.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse", "reuse"]
    assert config.kv_sources == (0, 1, 2, 3, 3, 2, 2)
    assert (config.global_head_dim, config.kind_shape(FULL), config.kind_shape(SLIDING)) == (32, (1, 32), (2, 16))
    cache = model.init_cache(len(PROMPTS), max_length=64)
    assert cache.stored_layers == (0, 1, 2, 3)
    assert cache.layer(2).keys.shape == (2, 1, 64, 32) and cache.layer(3).keys.shape == (2, 2, 4, 16)
    assert "wv_full" not in model.layers and "wv" in model.layers  # full layers' values are their keys
    with pytest.raises(ValueError, match="bidirectional attention are not supported"):
        Gemma4Config.model_validate(SMALL | {"use_bidirectional_attention": "all"})
    with pytest.raises(ValueError, match="enable_moe_block needs num_experts"):
        Gemma4Config.model_validate(SMALL | {"num_experts": None})


def test_prefill_and_decode_logits_match_transformers(checkpoint):
    _, _, model, sequences, expected, _ = checkpoint
    step = functools.partial(forward, *nnx.split(model))
    for kind in ("static", "dynamic"):
        cache = model.init_cache(len(PROMPTS), max_length=64, full_attention=kind)
        cache = check_teacher_forced(step, cache, sequences, PROMPTS, expected, DECODE_STEPS, f"gemma4 {kind}")
        assert np.asarray(cache.lengths).tolist() == [n + DECODE_STEPS for n in PROMPTS]
        assert not cache.shared_views



def test_early_exit_matches_transformers_first_layers(checkpoint):
    """``early_exit`` through the first reusing layer: transformers' hidden state after those
    layers through its norm, head and soft-cap; the cache holds the same tokens (layers 5 and 6
    store nothing)."""
    _, config, model, sequences, _, hf = checkpoint
    expected = hf_early_exit_logits(hf, sequences, EXIT_LAYERS, softcap=config.final_logit_softcapping)
    step = jax.jit(lambda tokens, positions, cache: model.early_exit(tokens, positions, cache, EXIT_LAYERS))
    cache = model.init_cache(len(PROMPTS), max_length=64)
    cache = check_teacher_forced(step, cache, sequences, PROMPTS, expected, EXIT_STEPS, "gemma4 early exit")
    assert np.asarray(cache.lengths).tolist() == [n + EXIT_STEPS for n in PROMPTS]


def test_prefill_at_logits_index_runs_reusing_layers_on_those_positions(checkpoint):
    """A prefill asking for each row's last prompt position: the layers that reuse K/V run on
    those positions only; the logits equal transformers' there."""
    _, _, model, sequences, expected, _ = checkpoint
    tokens = np.zeros((len(PROMPTS), max(PROMPTS)), np.int32)
    for row, n in enumerate(PROMPTS):
        tokens[row, :n] = sequences[row][:n]
    cache = model.init_cache(len(PROMPTS), max_length=64)
    last = jnp.asarray([n - 1 for n in PROMPTS])
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, tokens, positions, cache):
        return nnx.merge(graphdef, state)(tokens, positions, cache, logits_index=last)

    logits, cache = prefill(state, jnp.asarray(tokens), cache.next_positions(max(PROMPTS), num_new=PROMPTS), cache)
    assert logits.shape == (len(PROMPTS), 1, SMALL["vocab_size"])
    for row, n in enumerate(PROMPTS):
        np.testing.assert_allclose(logits[row, 0], expected[row][n - 1], atol=1e-4, rtol=0)
    assert np.asarray(cache.lengths).tolist() == PROMPTS


def test_greedy_generate_matches_transformers(checkpoint):
    """The jitted generate (bucketed prefill + while_loop decode), static and dynamic caches."""
    _, _, model, sequences, _, hf = checkpoint
    prompts = [seq[:n].tolist() for seq, n in zip(sequences, PROMPTS)]
    want = hf_greedy(hf, prompts, DECODE_STEPS, eos_token_id=None, pad_token_id=0)
    for kind in ("static", "dynamic"):
        result = generate(model, prompts, max_new_tokens=DECODE_STEPS, full_attention=kind)
        assert [result.row(row) for row in range(len(prompts))] == want, kind


def test_engine_with_pages_equals_generate(checkpoint):
    """Requests arriving at different steps, chunked past the window, the last one repeating the
    first's prompt (a prefix-cache hit): each gets ``generate``'s greedy tokens. The pools' pages
    hold the storing layers' K/V only, each layer type at its own head dim."""
    *_, model, sequences, _, _ = checkpoint
    prompts = [seq[:n].tolist() for seq in sequences for n in (9, 20)]
    prompts.append(prompts[1] + [3, 4])
    engine = Engine(model, kv_memory=256 * 1024, page_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    got = run_arrivals(engine, prompts, [0, 0, 2, 4, 30], 12)
    assert got == greedy_reference(model, prompts, 12)
    assert engine.stats().prefix_cache.hit_rate > 0
