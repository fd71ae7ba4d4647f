"""Llama-family logits equal transformers' on the same random weights, for every cache kind.

Each tiny config is built and saved by transformers (safetensors), loaded through our
checkpoint loader, and run as a ragged batch: a prefill, then 32 single-token decode
steps fed the same (teacher-forced) tokens. Every step's logits must match transformers'
full-sequence logits at those positions within 1e-4 (float32).
"""

import numpy as np
import pytest
import torch
import transformers

import jax.numpy as jnp

from jaxkv.generate import generate
from models.llama import Llama
from models.weights import load_safetensors_checkpoint

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
# "-unrolled": the model built with scan_layers=False (one weight buffer per layer).
CACHE_KINDS = {"llama": ["static", "dynamic", "static-unrolled"], "llama3-rope-tied": ["static"]}
CACHE_KINDS["qwen2-bias"] = ["static", "dynamic"]
CACHE_KINDS["mistral-window-8"] = ["static", "dynamic", "dynamic-unrolled"]  # every layer slides
PROMPTS = [17, 6]  # ragged rows
DECODE_STEPS = 32


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    config = CONFIGS[request.param]
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, SMALL["vocab_size"], n + DECODE_STEPS) for n in PROMPTS]
    with torch.no_grad():
        expected = [hf(torch.tensor(seq)[None]).logits[0].numpy() for seq in sequences]
    return request.param, directory, sequences, expected, hf


def test_prefill_and_decode_logits_match_transformers(checkpoint):
    name, directory, sequences, expected, _ = checkpoint
    config, params = load_safetensors_checkpoint(directory)
    for variant in CACHE_KINDS[name]:
        kind, _, loop = variant.partition("-")
        model = Llama(config, params, scan_layers=loop != "unrolled")
        cache = model.init_cache(len(PROMPTS), max_length=64, full_attention=kind)
        width = max(PROMPTS)
        tokens = np.zeros((len(PROMPTS), width), np.int32)
        for row, n in enumerate(PROMPTS):
            tokens[row, :n] = sequences[row][:n]
        cache = cache.reserve(width + DECODE_STEPS)
        positions = cache.next_positions(width, num_new=PROMPTS)
        logits, cache = model(jnp.asarray(tokens), positions, cache)
        for row, n in enumerate(PROMPTS):
            np.testing.assert_allclose(logits[row, :n], expected[row][:n], atol=1e-4, rtol=0, err_msg=f"{name} {variant}")
        for step in range(DECODE_STEPS):
            token = jnp.asarray([[seq[n + step]] for seq, n in zip(sequences, PROMPTS)], jnp.int32)
            logits, cache = model(token, cache.lengths[:, None], cache)
            for row, n in enumerate(PROMPTS):
                np.testing.assert_allclose(
                    logits[row, 0], expected[row][n + step], atol=1e-4, rtol=0, err_msg=f"{name} {variant} step {step}"
                )


def test_greedy_generate_matches_transformers(checkpoint):
    """The jitted generate (bucketed prefill + while_loop decode) reproduces HF's greedy
    tokens for each row of a ragged batch."""
    name, directory, sequences, _, hf = checkpoint
    config, params = load_safetensors_checkpoint(directory)
    prompts = [seq[:n].tolist() for seq, n in zip(sequences, PROMPTS)]
    result = generate(Llama(config, params), prompts, max_new_tokens=16)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert result.row(row) == want, name
