"""Gemma 3 (text) logits and greedy tokens equal transformers', on tiny random weights (the
real Gemma 3 270M GGUF: test_gemma3_gguf.py, compiled with full optimization).

Tiny configs are built and saved by transformers (safetensors), loaded through our checkpoint
loader and run as a ragged batch: a prefill, then 32 single-token decode steps fed the same
(teacher-forced) tokens. Every step's logits must match transformers' full-sequence logits at
those positions within 1e-4 (float32). 7 layers with the 5:1 pattern leave one layer after the
last full repeat, so the model's remainder path runs; the window (4) is far shorter than the
sequences, so sliding layers really slide.
"""

import functools
import os

import jax
import numpy as np
import pytest
import transformers
from flax import nnx

from jaxkv.decoding.generate import generate
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.weights import load_safetensors_checkpoint
from tests.parity import check_teacher_forced, hf_early_exit_logits, hf_greedy, save_tiny_hf_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = dict(
    vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=24, max_position_embeddings=256,
)  # fmt: skip
CONFIGS = {
    "gemma3-7-layers": transformers.Gemma3TextConfig(**SMALL),
    # Final logit soft-capping, linear RoPE scaling on the global layers (Gemma 3 4B+), untied head.
    # attn_logit_softcapping is set but, as in transformers' Gemma 3, not applied.
    "gemma3-softcap-linear-untied": transformers.Gemma3TextConfig(
        **SMALL,
        final_logit_softcapping=3.0,
        attn_logit_softcapping=5.0,
        tie_word_embeddings=False,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0},
        },
    ),
}
PROMPTS = [17, 6]  # ragged rows
DECODE_STEPS = 32
# Early exit after 4 of the 7 layers: fewer than one repeat of the pattern (6), so the scan
# runs no repeat and the 4 layers run after it; a prefill and 4 steps.
EXIT_LAYERS, EXIT_STEPS = 4, 4


@functools.partial(jax.jit, static_argnums=0)
def forward(graphdef, state, tokens, positions, cache):
    """One compiled model call (eager calls re-trace the layer scan every step)."""
    return nnx.merge(graphdef, state)(tokens, positions, cache)


@functools.partial(jax.jit, static_argnums=(0, 5))
def early_exit(graphdef, state, tokens, positions, cache, num_layers):
    return nnx.merge(graphdef, state).early_exit(tokens, positions, cache, num_layers)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    # Eager attention: the reference for soft-capped attention logits.
    sequences, expected, hf = save_tiny_hf_model(
        CONFIGS[request.param], directory, SMALL["vocab_size"], PROMPTS, DECODE_STEPS,
        perturb_norms=True, attn_implementation="eager",
    )  # fmt: skip
    return request.param, directory, sequences, expected, hf


def test_config_reads_transformers_names(checkpoint):
    name, directory, *_ = checkpoint
    config, _ = load_safetensors_checkpoint(directory)
    hf_config = CONFIGS[name]
    assert isinstance(config, Gemma3Config)
    assert (
        config.layer_types
        == tuple(hf_config.layer_types)
        == ("sliding_attention",) * 5 + ("full_attention",) * 1 + ("sliding_attention",)
    )
    for kind in ("sliding_attention", "full_attention"):
        ours, theirs = getattr(config.rope_parameters, kind), hf_config.rope_parameters[kind]
        assert ours.rope_theta == theirs["rope_theta"] and ours.rope_type == theirs["rope_type"]
    assert config.query_pre_attn_scalar == 24 and config.final_logit_softcapping == hf_config.final_logit_softcapping


def test_v4_config_names_give_the_same_config():
    """Older config.json files name the RoPE bases and the pattern differently."""
    v4 = Gemma3Config.model_validate(
        dict(SMALL, rope_theta=5000.0, rope_local_base_freq=100.0, sliding_window_pattern=3,
             rope_scaling={"rope_type": "linear", "factor": 4.0})  # fmt: skip
    )
    assert v4.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2 + ("sliding_attention",)
    assert v4.rope_parameters.sliding_attention.rope_theta == 100.0
    assert (v4.rope_parameters.full_attention.rope_theta, v4.rope_parameters.full_attention.factor) == (5000.0, 4.0)
    with pytest.raises(ValueError, match="hidden_activation 'gelu' is not supported"):
        Gemma3Config.model_validate(dict(SMALL, hidden_activation="gelu"))


def test_prefill_and_decode_logits_match_transformers(checkpoint):
    name, directory, sequences, expected, _ = checkpoint
    config, params = load_safetensors_checkpoint(directory)
    model = Gemma3(config, params)
    graphdef, state = nnx.split(model)
    for kind in ("static", "dynamic"):
        cache = model.init_cache(len(PROMPTS), max_length=64, full_attention=kind)
        assert cache.period == 6  # the scan runs one repeat of 6, then layer 6 alone
        step = functools.partial(forward, graphdef, state)
        cache = check_teacher_forced(step, cache, sequences, PROMPTS, expected, DECODE_STEPS, f"{name} {kind}")
        assert np.asarray(cache.lengths).tolist() == [n + DECODE_STEPS for n in PROMPTS]


def test_early_exit_matches_transformers_first_layers(checkpoint):
    """``early_exit`` runs the first layers, then the final norm, head and soft-cap: HF's
    hidden state after those layers through its norm and head. Later layers' cache entries
    stay empty."""
    name, directory, sequences, _, hf = checkpoint
    config, params = load_safetensors_checkpoint(directory)
    expected = hf_early_exit_logits(hf, sequences, EXIT_LAYERS, softcap=config.final_logit_softcapping)
    model = Gemma3(config, params)
    step = functools.partial(early_exit, *nnx.split(model), num_layers=EXIT_LAYERS)
    cache = model.init_cache(len(PROMPTS), max_length=64)
    cache = check_teacher_forced(step, cache, sequences, PROMPTS, expected, EXIT_STEPS, f"{name} early exit")
    lengths = [np.asarray(layer.lengths).tolist() for layer in cache.layers]
    assert lengths == [[n + EXIT_STEPS for n in PROMPTS]] * EXIT_LAYERS + [[0, 0]] * (7 - EXIT_LAYERS)


def test_greedy_generate_matches_transformers(checkpoint):
    """The jitted generate (bucketed prefill + while_loop decode) reproduces HF's greedy
    tokens for each row of a ragged batch."""
    name, directory, sequences, _, hf = checkpoint
    config, params = load_safetensors_checkpoint(directory)
    prompts = [seq[:n].tolist() for seq, n in zip(sequences, PROMPTS)]
    result = generate(Gemma3(config, params), prompts, max_new_tokens=16)
    for row, want in enumerate(hf_greedy(hf, prompts, 16, eos_token_id=None, pad_token_id=0)):
        assert result.row(row) == want, name
