"""Beam search on real weights equals transformers' ``generate(num_beams=...)``: SmolLM2-135M-Instruct,
chat prompts, end-of-turn stops. Its own file, so that it compiles with full optimization
(``OPTIMIZED_FILES`` in tests/conftest.py: real weights, many tokens); the tiny random Llama's
cases are in test_beam.py.
"""

import os

import numpy as np
import torch
import transformers

from jaxkv.decoding.beam import BeamSettings, beam_search
from jaxkv.models.defaults import resolve_model
from jaxkv.models.load import load_pretrained

NEW_SMOLLM2 = 32
SMOLLM2_QUESTIONS = [
    "Explain why the sky is blue to a ten year old.",
    "Name three fruits.",
    "What is a key-value cache in a transformer, and why does it make generation faster?",
]


def test_smollm2_beam_search_equals_transformers():
    """SmolLM2-135M-Instruct (GGUF): a ragged batch of chat prompts in one call, 32 new
    tokens, end-of-turn stops, 3 beams, early stopping, two returned hypotheses each."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_pretrained("smollm2")
    path = resolve_model("smollm2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    settings = BeamSettings(3, length_penalty=1.0, early_stopping=True, num_return_sequences=2)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in SMOLLM2_QUESTIONS
    ]
    stops = tokenizer.eos_token_ids
    result = beam_search(
        model, prompts, max_new_tokens=NEW_SMOLLM2, num_beams=settings.num_beams, early_stopping=True,
        num_return_sequences=settings.num_return_sequences, stop_tokens=stops,
    )  # fmt: skip
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_SMOLLM2, do_sample=False, num_beams=settings.num_beams, length_penalty=1.0,
                early_stopping=True, num_return_sequences=settings.num_return_sequences, eos_token_id=stops,
                return_dict_in_generate=True, output_scores=True,
            )  # fmt: skip
        lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
        for rank, n in enumerate(lengths):
            want = out.sequences[rank, len(prompt) : len(prompt) + n].tolist()
            assert result.sequence(row, rank) == want, f"prompt {row} hypothesis {rank}"
        np.testing.assert_allclose(result.scores[row], out.sequences_scores.numpy(), rtol=1e-3)
    assert result.lengths.max() == NEW_SMOLLM2 and result.lengths.min() < NEW_SMOLLM2  # long answers and a stopped one
