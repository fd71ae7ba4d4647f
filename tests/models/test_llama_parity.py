"""Llama-family logits equal transformers' on the same random weights, for every cache kind.

Each tiny config is built and saved by transformers (safetensors), loaded through our
checkpoint loader, and run as a ragged batch: a prefill, then 32 single-token decode
steps fed the same (teacher-forced) tokens. Every step's logits must match transformers'
full-sequence logits at those positions within 1e-4 (float32).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

from jaxkv.decoding.generate import generate
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.models.weights import load_safetensors_checkpoint
from tests.parity import check_teacher_forced, hf_early_exit_logits, hf_greedy, save_tiny_hf_model

SMALL = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip
CONFIGS = {
    "llama": transformers.LlamaConfig(**SMALL, rope_theta=500.0),
    "llama3-rope-tied": transformers.LlamaConfig(
        **SMALL,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        },  # fmt: skip
    ),
    "mistral-window-8": transformers.MistralConfig(**SMALL, sliding_window=8),
    "qwen2-bias": transformers.Qwen2Config(**SMALL),
}
# "-unrolled": the model built with scan_layers=False (one weight buffer per layer);
# "-in_out": weight_layout="in_out" (matrices stored [in, out], applied as x @ w; the default is [out, in]).
MODEL_OPTIONS = {"": {}, "unrolled": {"scan_layers": False}, "in_out": {"weight_layout": "in_out"}}
CACHE_KINDS = {"llama": ["static", "dynamic", "static-unrolled"], "llama3-rope-tied": ["static", "static-in_out"]}
CACHE_KINDS["qwen2-bias"] = ["static", "dynamic", "dynamic-in_out"]
CACHE_KINDS["mistral-window-8"] = ["static", "dynamic", "dynamic-unrolled"]  # every layer slides
PROMPTS = [17, 6]  # ragged rows
DECODE_STEPS = 32
EXIT_LAYERS, EXIT_STEPS = 2, 4  # early exit after 2 of the 3 layers, for a prefill and 4 steps


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    sequences, expected, hf = save_tiny_hf_model(
        CONFIGS[request.param], directory, SMALL["vocab_size"], PROMPTS, DECODE_STEPS
    )
    return request.param, directory, sequences, expected, hf


def test_prefill_and_decode_logits_match_transformers(checkpoint):
    name, directory, sequences, expected, _ = checkpoint
    config, params = load_safetensors_checkpoint(directory)
    for variant in CACHE_KINDS[name]:
        kind, _, options = variant.partition("-")
        model = Llama(config, params, **MODEL_OPTIONS[options])
        cache = model.init_cache(len(PROMPTS), max_length=64, full_attention=kind)
        check_teacher_forced(model, cache, sequences, PROMPTS, expected, DECODE_STEPS, f"{name} {variant}")


def test_early_exit_matches_transformers_first_layers(checkpoint):
    """``early_exit`` runs the first layers, then the final norm and head: HF's hidden state
    after those layers through its norm and head, scanned or unrolled. The last layer's cache
    entry stays empty."""
    name, directory, sequences, _, hf = checkpoint
    config, params = load_safetensors_checkpoint(directory)
    expected = hf_early_exit_logits(hf, sequences, EXIT_LAYERS)
    for options in ("", "unrolled"):
        model = Llama(config, params, **MODEL_OPTIONS[options])
        forward = functools.partial(model.early_exit, num_layers=EXIT_LAYERS)
        cache = model.init_cache(len(PROMPTS), max_length=64)
        label = f"{name} {options} early exit"
        cache = check_teacher_forced(forward, cache, sequences, PROMPTS, expected, EXIT_STEPS, label)
        assert np.asarray(cache.layer(EXIT_LAYERS - 1).lengths).tolist() == [n + EXIT_STEPS for n in PROMPTS]
        assert np.asarray(cache.layer(EXIT_LAYERS).lengths).tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 3\], got 4"):
        model.early_exit(jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), cache, num_layers=4)


def test_greedy_generate_matches_transformers(checkpoint):
    """The jitted generate (bucketed prefill + while_loop decode) reproduces HF's greedy
    tokens for each row of a ragged batch."""
    name, directory, sequences, _, hf = checkpoint
    config, params = load_safetensors_checkpoint(directory)
    prompts = [seq[:n].tolist() for seq, n in zip(sequences, PROMPTS)]
    result = generate(Llama(config, params), prompts, max_new_tokens=16)
    for row, want in enumerate(hf_greedy(hf, prompts, 16, eos_token_id=None, pad_token_id=0)):
        assert result.row(row) == want, name


def test_out_in_layout_reads_scanned_weights_in_place_at_batch_one():
    """A one-row, one-token step of the scanned model: with [in, out] matrices XLA's CPU
    backend copies each layer's weight slice out of the stack (a temporary of at least
    the largest matrix); with weight_layout="out_in" the slice feeds the matrix-vector
    product in place. Both give the same logits."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    largest_matrix = 256 * 1024 * 4

    def step(model):
        cache = model.init_cache(1, max_length=32)
        graphdef, state = nnx.split(model)

        def call(state, cache, tokens):
            return nnx.merge(graphdef, state)(tokens, cache.next_positions(1), cache)

        tokens = jnp.asarray([[5]])
        compiled = jax.jit(call, donate_argnums=1).lower(state, cache, tokens).compile()
        logits, _ = compiled(state, cache, tokens)
        return compiled.memory_analysis().temp_size_in_bytes, logits

    copied, want = step(Llama(config, weight_layout="in_out"))
    in_place, got = step(Llama(config))  # weight_layout="out_in", the default
    assert copied >= largest_matrix > 4 * in_place, (copied, in_place)
    np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="weight_layout must be"):
        Llama(config, weight_layout="row_major")
