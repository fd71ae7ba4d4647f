"""Models whose matrices stay quantized (``load_pretrained(weights=...)``) against the same model
dense: the real GGUF models with their file's blocks ("gguf") give the dequantized-float32 model's
greedy tokens (a divergence allowed only at a tie: the dense model's top two logits within 1e-4,
counted) and its perplexity on the Lee corpus within 0.1%; "int8" / "int4" quantize a float
checkpoint; the blocks' conversion is cached; bad arguments name themselves."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
from jaxkv.models.load import Pretrained, load_pretrained

from jaxkv.decoding.generate import generate
from jaxkv.kernels.quantized import is_quantized
from jaxkv.persist import weights_fingerprint
from jaxkv.research.corpus import corpus_text
from jaxkv.serving import Engine
from tests.cases import PARAGRAPH, greedy_reference, run_arrivals
from tests.parity import save_tiny_hf_model

PROMPTS = ["The capital of France is", PARAGRAPH * 2 + "In summary, the printing press"]
NEW_TOKENS = 24
TIE = 1e-4  # the dense model's top-two logit gap under which a different greedy choice is a tie
PERPLEXITY_TOKENS = 257  # one window: 256 predictions


def _forward_logits(model, ids: list[int]) -> np.ndarray:
    """The model's logits ``[T, V]`` over ``ids`` in one prefill."""
    tokens = jnp.asarray(ids, jnp.int32)[None]
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    graphdef, state = nnx.split(model)  # the weights as arguments, not as constants of the computation
    forward = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
    logits, _ = forward(state, tokens, positions, model.init_cache(1, len(ids)))
    return np.asarray(logits[0], np.float64)


def _ties_then_equal(dense, kept, prompts: list[list[int]]) -> int:
    """Greedy tokens of ``kept`` equal ``dense``'s; at a first difference the dense model's top two
    logits there must be within ``TIE`` (the rest of that row is not compared). Returns the ties."""
    want, got = generate(dense, prompts, max_new_tokens=NEW_TOKENS), generate(kept, prompts, max_new_tokens=NEW_TOKENS)
    ties = 0
    for row, prompt in enumerate(prompts):
        a, b = want.row(row), got.row(row)
        diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if diff is None:
            continue
        logits = _forward_logits(dense, prompt + a[:diff])[-1]
        top = np.sort(logits)[-2:]
        assert top[1] - top[0] < TIE, f"row {row} diverges at token {diff} where the dense model is sure"
        ties += 1
    return ties


def _perplexity(model, ids: list[int]) -> float:
    logits = _forward_logits(model, ids)[:-1]
    logits = logits - logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(np.exp(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean()))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def pair(request):
    """The dense float32 model, the model with its file's blocks kept, and the tokenizer."""
    source = Pretrained(request.param)
    tokenizer = source.tokenizer()
    return source.model(weights="dense"), source.model(weights="gguf"), tokenizer


def test_the_file_blocks_are_kept(pair):
    dense, kept, _ = pair
    kept_names = {name for name, param in kept.layers.items() if is_quantized(param[...])}
    assert {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"} <= kept_names
    assert is_quantized(kept.embed[...]) and not is_quantized(kept.norm[...])
    kept_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(kept, nnx.Param)))
    dense_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(dense, nnx.Param)))
    assert kept_bytes < dense_bytes / 3  # 4-8 bit blocks against float32


def test_greedy_tokens_equal_the_dense_model(pair):
    dense, kept, tokenizer = pair
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    assert _ties_then_equal(dense, kept, prompts) <= 1


def test_perplexity_equals_the_dense_model(pair):
    dense, kept, tokenizer = pair
    ids = tokenizer.encode(corpus_text())[:PERPLEXITY_TOKENS]
    want, got = _perplexity(dense, ids), _perplexity(kept, ids)
    assert abs(got / want - 1) < 1e-3, (want, got)
    assert 1 < want < 100


def test_unrolled_layers_equal_scanned():
    model, _ = load_pretrained("smollm2", weights="gguf")
    unrolled, _ = load_pretrained("smollm2", weights="gguf", scan_layers=False)
    ids = list(range(100, 140))
    np.testing.assert_allclose(_forward_logits(unrolled, ids), _forward_logits(model, ids), rtol=0, atol=1e-3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama checkpoint with 64-wide rows (two blocks of 32)."""
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("tiny_llama")
    sequences, expected, _ = save_tiny_hf_model(config, directory, 96, [12], 0)
    return directory, sequences[0].tolist(), expected[0]


@pytest.mark.parametrize(("weights", "fmt", "tolerance"), [("int8", "q8_0", 0.02), ("int4", "q4_1", 0.25)])
def test_a_float_checkpoint_quantized_at_load(checkpoint, weights, fmt, tolerance):
    directory, ids, expected = checkpoint
    model, _ = load_pretrained(directory, weights=weights)
    assert model.layers["wq"][...].format == fmt and model.embed[...].format == fmt
    logits = _forward_logits(model, ids)
    assert np.abs(logits - expected).max() < tolerance * np.abs(expected).max()


def test_bad_weights_name_the_argument(checkpoint):
    directory, _, _ = checkpoint
    with pytest.raises(ValueError, match="weights must be one of"):
        load_pretrained(directory, weights="int3")
    with pytest.raises(ValueError, match="weights='gguf' keeps a GGUF file's blocks"):
        load_pretrained(directory, weights="gguf")


def test_the_blocks_conversion_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = Pretrained("smollm2").model(weights="gguf")
    files = sorted(tmp_path.glob("jaxkv/converted/*.blocks.safetensors"))
    assert len(files) == 1
    header = json.loads(files[0].read_bytes()[8 : 8 + int.from_bytes(files[0].read_bytes()[:8], "little")])
    assert json.loads(header["__metadata__"]["kept_formats"])["wq"] == "q4_1"
    second = Pretrained("smollm2").model(weights="gguf")  # read back from the cache
    assert weights_fingerprint(first) == weights_fingerprint(second)
    blocks = [np.asarray(model.layers["wq"][...].blocks) for model in (first, second)]
    np.testing.assert_array_equal(*blocks)


def test_the_engine_over_kept_blocks_equals_generate():
    """Decode rows (the one-pass kernel) and packed prefill chunks (more rows than ``GEMV_ROWS``:
    dequantize and dot) in one engine step, each request's greedy tokens equal to ``generate``'s."""
    model, tokenizer = load_pretrained("smollm2", weights="gguf")
    prompts = [tokenizer.encode(text) for text in PROMPTS + ["Bees make honey because"]]
    engine = Engine(model, kv_memory="32MiB", max_num_seqs=4, max_num_batched_tokens=64)
    assert run_arrivals(engine, prompts, [0, 1, 3], 12) == greedy_reference(model, prompts, 12)
