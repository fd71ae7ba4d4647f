"""Qwen3.5 (gated DeltaNet + gated attention) logits and generation equal transformers'.

A tiny random Qwen3.5 text model (3 linear-attention layers : 1 full-attention layer, the
real pattern, plus one linear layer past the last full repeat) is built and saved by
transformers, loaded through our checkpoint loader, and run as a ragged batch: a prefill,
32 teacher-forced decode steps, then a speculative rollback of 3 tokens and their re-feed
as one 3-token update. Every step's logits must
equal transformers' full-sequence logits within 1e-4 (float32). All weights, norms
included, are redrawn larger than transformers' init so that every term matters.
"""

import functools

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxkv.decoding.generate import generate
from jaxkv.decoding.sampling import Sampling
from jaxkv.decoding.speculative import PromptLookup, generate_speculative
from jaxkv.models.qwen3_5 import Qwen3_5
from jaxkv.models.weights import load_safetensors_checkpoint

CONFIG = {
    "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 5, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "max_position_embeddings": 256,
}  # fmt: skip
PROMPTS = [17, 6]  # ragged rows
DECODE_STEPS, UNDO = 32, 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if not name.endswith("A_log"):  # A_log keeps its init: exp(A_log) sets the decay rates
                param.normal_(0.0, 0.2)
    directory = tmp_path_factory.mktemp("qwen3_5")
    hf.save_pretrained(directory)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, CONFIG["vocab_size"], n + DECODE_STEPS) for n in PROMPTS]
    with torch.no_grad():
        expected = [hf(torch.tensor(seq)[None]).logits[0].numpy() for seq in sequences]
    config, params = load_safetensors_checkpoint(directory)
    return Qwen3_5(config, params), hf, sequences, expected


@functools.partial(jax.jit, static_argnames="graphdef")
def forward(graphdef, state, tokens, positions, cache):
    return nnx.merge(graphdef, state)(tokens, positions, cache)


def test_prefill_decode_and_rollback_logits_match_transformers(checkpoint):
    model, _, sequences, expected = checkpoint
    graphdef, state = nnx.split(model)
    width = max(PROMPTS)
    cache = model.init_cache(len(PROMPTS), max_length=64, rollback_slots=UNDO)
    tokens = np.zeros((len(PROMPTS), width), np.int32)
    for row, n in enumerate(PROMPTS):
        tokens[row, :n] = sequences[row][:n]
    logits, cache = forward(graphdef, state, tokens, cache.next_positions(width, num_new=PROMPTS), cache)
    for row, n in enumerate(PROMPTS):
        np.testing.assert_allclose(logits[row, :n], expected[row][:n], atol=1e-4, rtol=0, err_msg="prefill")
    for step in range(DECODE_STEPS):
        token = np.asarray([[seq[n + step]] for seq, n in zip(sequences, PROMPTS)], np.int32)
        logits, cache = forward(graphdef, state, token, cache.lengths[:, None], cache)
        for row, n in enumerate(PROMPTS):
            np.testing.assert_allclose(
                logits[row, 0], expected[row][n + step], atol=1e-4, rtol=0, err_msg=f"step {step}"
            )
    # Speculative decoding: undo the last UNDO tokens, feed them again as one update.
    cache = cache.rollback(UNDO)
    redo = np.asarray([seq[n + DECODE_STEPS - UNDO : n + DECODE_STEPS] for seq, n in zip(sequences, PROMPTS)], np.int32)
    logits, cache = forward(graphdef, state, redo, cache.next_positions(UNDO), cache)
    for row, n in enumerate(PROMPTS):
        want = expected[row][n + DECODE_STEPS - UNDO : n + DECODE_STEPS]
        np.testing.assert_allclose(logits[row], want, atol=1e-4, rtol=0, err_msg="after rollback")
    np.testing.assert_array_equal(cache.lengths, np.asarray(PROMPTS) + DECODE_STEPS)


def test_greedy_and_sampled_generate(checkpoint):
    """The jitted generate reproduces HF's greedy tokens for each row of a ragged batch;
    sampling (top-k 3) is reproducible for a seed and only ever picks one of the top 3
    tokens of transformers' logits for the sequence so far."""
    model, hf, sequences, _ = checkpoint
    prompts = [seq[:n].tolist() for seq, n in zip(sequences, PROMPTS)]
    greedy = generate(model, prompts, max_new_tokens=16)
    sampling = Sampling(temperature=1.0, top_k=3)
    sampled = generate(model, prompts, max_new_tokens=16, sampling=sampling, seed=3)
    again = generate(model, prompts, max_new_tokens=16, sampling=sampling, seed=3)
    np.testing.assert_array_equal(sampled.tokens, again.tokens)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(prompt) :].tolist()
            full = torch.tensor([prompt + sampled.row(row)])
            logits = hf(full).logits[0, len(prompt) - 1 : -1].numpy()
        assert greedy.row(row) == want
        top3 = np.argsort(-logits, axis=-1)[:, :3]
        assert all(token in top for token, top in zip(sampled.row(row), top3)), (sampled.row(row), top3)
    assert sampled.tokens.tolist() != greedy.tokens.tolist()


def test_speculative_greedy_equals_plain_greedy(checkpoint):
    """Speculative decoding on the hybrid model: every rejected draft rolls the
    linear-attention states back (they keep the states of the last k steps), and the
    output equals plain greedy decoding token for token."""
    model, _, sequences, _ = checkpoint
    # Repeated halves give prompt lookup matches to propose; the random model rejects most.
    prompts = [seq[: n // 2].tolist() * 2 for seq, n in zip(sequences, PROMPTS)]
    plain = generate(model, prompts, max_new_tokens=16)
    spec = generate_speculative(model, prompts, drafter=PromptLookup(), num_draft_tokens=3, max_new_tokens=16)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert spec.finish == plain.finish
    assert np.sum(spec.accepted) < 3 * np.sum(spec.target_steps), "no draft was rejected: rollback not exercised"
