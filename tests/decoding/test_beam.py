"""Beam search equals transformers' ``generate(num_beams=...)``: same hypotheses, same order,
same scores, for every early-stopping mode, several length penalties and return counts.

A tiny random Llama (its weights scaled up so next-token distributions are peaked, not
near-uniform ties) is saved by transformers and loaded through our checkpoint loader; a
ragged batch is searched at once and each row compared with transformers run on that
prompt alone. Stop tokens are tokens the model actually produces, so hypotheses finish
at different lengths and early stopping matters. SmolLM2's beams against transformers':
test_beam_smollm2.py (real weights, compiled with full optimization).
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxkv.decoding.beam import BeamSettings, beam_search
from jaxkv.decoding.sampling import Sampling
from jaxkv.cli.generate import GenerateConfig
from jaxkv.cli.main import main
from jaxkv.config import load_config
from jaxkv.sizing import bucket
from jaxkv.models.llama import Llama
from jaxkv.models.weights import load_safetensors_checkpoint

SMALL = {
    "vocab_size": 61, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "initializer_range": 0.25,
}  # fmt: skip
PROMPTS = [[5, 17, 3, 44, 9, 30, 12], [8, 1, 50], [23, 23, 7, 2, 60]]
NEW_TOKENS = 14


def build(config, directory):
    """transformers' model for ``config`` (seeded), ours loaded from its checkpoint, and
    tokens greedy decoding emits early (likely stops for some beams)."""
    torch.manual_seed(1)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.generation_config.eos_token_id = None  # stop only on the tokens each test passes
    hf.save_pretrained(directory)
    config, params = load_safetensors_checkpoint(directory)
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    return hf, Llama(config, params), [int(t) for t in greedy[0, len(PROMPTS[0]) :]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build(transformers.LlamaConfig(**SMALL), tmp_path_factory.mktemp("tiny-beam"))


def transformers_beams(hf, prompt, stops, settings: BeamSettings):
    """transformers' hypotheses for one prompt: (generated tokens, score) best first."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=settings.num_beams,
            length_penalty=settings.length_penalty, early_stopping=settings.early_stopping,
            num_return_sequences=settings.num_return_sequences, eos_token_id=stops or None, pad_token_id=0,
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    sequences = [out.sequences[i, len(prompt) : len(prompt) + n].tolist() for i, n in enumerate(lengths)]
    return sequences, out.sequences_scores.numpy()


CASES = {
    "4 beams, lp 1, early_stopping False, return 2": (BeamSettings(4, 1.0, False, 2), 1),
    "3 beams, lp 2, early_stopping never, return 3": (BeamSettings(3, 2.0, "never", 3), 1),
    "4 beams, lp -1, early_stopping True, 2 stops": (BeamSettings(4, -1.0, True, 1), 2),
    "2 beams, lp 0, early_stopping never, no stop": (BeamSettings(2, 0.0, "never", 2), 0),
    "3 beams, lp 0.5, early_stopping True, dynamic": (BeamSettings(3, 0.5, True, 3), 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_beam_search_equals_transformers(tiny, case):
    hf, model, common = tiny
    settings, num_stops = CASES[case]
    stops = common[1 : 1 + num_stops]
    result = beam_search(
        model, PROMPTS, max_new_tokens=NEW_TOKENS, num_beams=settings.num_beams,
        length_penalty=settings.length_penalty, early_stopping=settings.early_stopping,
        num_return_sequences=settings.num_return_sequences, stop_tokens=stops,
        full_attention="dynamic" if "dynamic" in case else "static",
    )  # fmt: skip
    assert result.tokens.shape == (len(PROMPTS), settings.num_return_sequences, NEW_TOKENS)
    finished_early = 0
    for row, prompt in enumerate(PROMPTS):
        want, want_scores = transformers_beams(hf, prompt, stops, settings)
        got = [result.sequence(row, rank) for rank in range(settings.num_return_sequences)]
        assert got == want, f"{case}: prompt {row}"
        np.testing.assert_allclose(result.scores[row], want_scores, rtol=1e-4, atol=1e-4)
        finished_early += sum(len(seq) < NEW_TOKENS for seq in got)
    if num_stops and settings.length_penalty <= 1:  # a larger penalty rightly prefers long hypotheses
        assert finished_early, f"{case}: no hypothesis ended on a stop token, the stops test nothing"


def test_sliding_window_cache_beams_equal_transformers(tmp_path):
    """Mistral-style sliding window of 6: the ring buffers are reordered every step while
    the sequences run past the window."""
    hf, model, common = build(transformers.MistralConfig(**SMALL, sliding_window=6), tmp_path)
    settings = BeamSettings(3, 1.0, False, 2)
    result = beam_search(
        model, PROMPTS, max_new_tokens=NEW_TOKENS, num_beams=3, num_return_sequences=2, stop_tokens=common[1:2]
    )
    for row, prompt in enumerate(PROMPTS):
        want, want_scores = transformers_beams(hf, prompt, common[1:2], settings)
        assert [result.sequence(row, rank) for rank in range(2)] == want, f"prompt {row}"
        np.testing.assert_allclose(result.scores[row], want_scores, rtol=1e-4, atol=1e-4)


def test_one_beam_is_greedy_and_bad_settings_are_named(tiny):
    hf, model, _ = tiny
    result = beam_search(model, PROMPTS[:1], max_new_tokens=NEW_TOKENS, num_beams=1)
    with torch.no_grad():
        greedy = hf.generate(torch.tensor(PROMPTS[:1]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    assert result.sequence(0) == greedy[0, len(PROMPTS[0]) :].tolist()
    with pytest.raises(ValueError, match="num_return_sequences"):
        BeamSettings(2, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSettings(2, early_stopping="always")
    with pytest.raises(ValueError, match="num_beams"):
        BeamSettings(0)
    with pytest.raises(ValueError, match="raise max_length"):
        beam_search(model, PROMPTS[:1], max_new_tokens=NEW_TOKENS, num_beams=2, max_length=16)
    with pytest.raises(ValueError, match="drop sampling, seed and stream"):
        beam_search(model, PROMPTS[:1], max_new_tokens=NEW_TOKENS, num_beams=2, sampling=Sampling(temperature=1.0))


def test_prompt_is_prefilled_once_and_cache_repeated(tiny, monkeypatch):
    """The model runs the prompt once for B rows; every later call feeds one token per beam."""
    _, model, _ = tiny
    calls = []
    original = Llama.__call__

    def recording(self, tokens, positions, cache, logits_index=None):
        calls.append((tokens.shape, cache.batch_size))
        return original(self, tokens, positions, cache, logits_index)

    monkeypatch.setattr(Llama, "__call__", recording)
    beam_search(model, PROMPTS, max_new_tokens=5, num_beams=3, dtype=jnp.float32, max_length=48)
    prompt_calls = [shape for shape, _ in calls if shape[1] > 1]
    assert prompt_calls == [(len(PROMPTS), bucket(max(map(len, PROMPTS))))]
    assert {(shape, rows) for shape, rows in calls if shape[1] == 1} == {((3 * len(PROMPTS), 1), 3 * len(PROMPTS))}


def test_cli_beam_flags(capsys):
    """``jaxkv generate --num-beams``: prints each returned hypothesis with its score; beams
    with sampling or too many return sequences are refused before any model loads."""
    argv = ["generate", "--model", "smollm2", "--prompt", "Name a colour.", "--max-new-tokens", "4"]
    assert main([*argv, "--num-beams", "2", "--num-return-sequences", "2", "--early-stopping", "never"]) == 0
    out, err = capsys.readouterr()
    assert out.count("--- hypothesis") == 2 and "2 beams" in err, (out, err)
    assert main([*argv, "--num-beams", "2", "--temperature", "0.7"]) == 2
    assert "deterministic beam search" in capsys.readouterr().err
    assert main([*argv, "--num-beams", "2", "--num-return-sequences", "3"]) == 2
    assert "exceeds num_beams" in capsys.readouterr().err
    shipped = load_config(Path(__file__).parents[2] / "configs" / "smollm2-beam.yaml", GenerateConfig)
    assert (shipped.num_beams, shipped.early_stopping, shipped.num_return_sequences) == (4, True, 2)
