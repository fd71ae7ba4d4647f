"""Eviction parity with kvpress on SmolLM2-135M-Instruct: after one prefill of 300 tokens of the
Lee corpus, each layer and K/V head of jaxkv's evicting cache holds exactly the positions
kvpress's press keeps (``tests/kvpress_oracle.py``), for SnapKV, PyramidKV, StreamingLLM and the
key norm, at compression ratios 0.5 and 0.25 (both sides count ``int(L * (1 - ratio))`` slots;
PyramidKV's layers ``PyramidKVPress.get_layer_budget``'s, which ``EvictionSpec.layer_budgets``
equals at every prompt length, ratio, window, steepness and depth tried here).

StreamingLLM scores by position: the sets must be equal. SnapKV and the key norm rank float32
scores that jaxkv and transformers compute with different rounding (keys differ by ~1e-6), and
a prompt's repeated tokens give equal key norms in layer 0 (RoPE is a rotation), so two
positions on the budget's cut can trade places. The scores jaxkv keeps must equal kvpress's
(rtol 1e-5), and a swap is accepted only between ties: positions whose kvpress score lies within
``TIE_RTOL`` of kvpress's cut. On this prompt SnapKV's and PyramidKV's sets are equal (SnapKV's
nearest score to the cut is 1.7e-4 relative away); of the 90 layer-heads, the key norm swaps one
position in one (ratio 0.5: layer 0, a repeated token) and in two (ratio 0.25: layer 0, a
repeated token; layer 19, 3.9e-7 from the cut).
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import kvpress
import numpy as np
import pytest

from jaxkv.research.corpus import corpus_text
from jaxkv.eviction import EvictionSpec
from jaxkv.models.load import load_pretrained
from tests.kvpress_oracle import capture_prefill, kvpress_kept_positions, kvpress_scores, load_hf_smollm2

PROMPT_TOKENS = 300
RATIOS = (0.5, 0.25)
SNAPKV_WINDOW, SNAPKV_KERNEL = 64, 5  # kvpress's defaults, passed explicitly to both sides
SINKS = 4  # StreamingLLM's n_sink
# Scores closer than this (relative) to kvpress's cut are ties: jaxkv's keys differ from
# transformers' by ~1e-6 relative, and the key-norm ties found on this prompt are within 4e-7.
TIE_RTOL = 1e-6


@pytest.fixture(scope="module")
def smollm2():
    """jaxkv's SmolLM2 (float32) and the prompt: ``PROMPT_TOKENS`` ids of the corpus."""
    model, tokenizer = load_pretrained("smollm2")
    tokens = tokenizer.encode(corpus_text(), add_special_tokens=False)[:PROMPT_TOKENS]
    assert len(tokens) == PROMPT_TOKENS
    return model, tokens


@pytest.fixture(scope="module")
def captured(smollm2):
    """transformers' prefill of the same prompt, every attention call recorded for kvpress."""
    return capture_prefill(load_hf_smollm2(), smollm2[1])


def jaxkv_prefill(model, tokens, spec: EvictionSpec) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Prefill ``tokens`` in one chunk into an evicting cache of ``max_length = len(tokens)``;
    return each layer's kept positions and their stored scores, both ``[H_kv, n_kept]`` (``n_kept``:
    the layer's budget)."""
    length = len(tokens)
    cache = model.init_cache(1, max_length=length, eviction=spec)
    _, cache = model(jnp.asarray([tokens], jnp.int32), jnp.arange(length, dtype=jnp.int32)[None], cache)
    # Read on the host: each layer's slices of the stacked arrays as NumPy views (indexing the device
    # arrays eagerly compiles a slice per layer index and leaf).
    layers = jax.device_get(cache).layers
    return (
        [np.asarray(layer.slot_positions[0]) for layer in layers],
        [np.asarray(layer.scores[0], np.float64) for layer in layers],
    )


def untied_swaps(got, want, scores) -> list[str]:
    """Layer-heads whose kept sets differ other than by a tie. ``got``/``want``, per layer ``[H_kv, n]``:
    jaxkv's and kvpress's kept positions; ``scores`` ``[layers, H_kv, L]`` kvpress's. A position
    kept by one side only is a tie when kvpress's score of it lies within ``TIE_RTOL`` of kvpress's
    cut (the lowest score it keeps): float32 rounding can order such positions either way."""
    problems = []
    for layer, (layer_got, layer_want) in enumerate(zip(got, want)):
        for head, (kept, expected) in enumerate(zip(layer_got, layer_want)):
            score = scores[layer, head]
            swapped = np.setxor1d(kept, expected)
            cut = score[expected].min()
            distance = np.abs(score[swapped] - cut).max(initial=0.0) / abs(cut)
            if distance > TIE_RTOL:
                problems.append(
                    f"layer {layer} head {head}: jaxkv keeps {np.setdiff1d(kept, expected).tolist()}, kvpress "
                    f"{np.setdiff1d(expected, kept).tolist()}; up to {distance:.3g} (relative) from kvpress's cut "
                    f"{cut:.9g}"
                )
    return problems


@pytest.mark.parametrize("ratio", RATIOS)
def test_streaming_llm_keeps_kvpress_positions(smollm2, captured, ratio):
    model, tokens = smollm2
    want = kvpress_kept_positions(captured, kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=SINKS))
    got, _ = jaxkv_prefill(model, tokens, EvictionSpec("streaming_llm", compression_ratio=ratio, sinks=SINKS))
    np.testing.assert_array_equal(np.stack(got), np.stack(want))


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize(
    ("press", "spec"),
    [
        (
            lambda ratio: kvpress.SnapKVPress(
                compression_ratio=ratio, window_size=SNAPKV_WINDOW, kernel_size=SNAPKV_KERNEL
            ),
            lambda ratio: EvictionSpec(
                "snapkv", compression_ratio=ratio, window=SNAPKV_WINDOW, kernel_size=SNAPKV_KERNEL
            ),
        ),
        (
            lambda ratio: kvpress.PyramidKVPress(
                compression_ratio=ratio, window_size=SNAPKV_WINDOW, kernel_size=SNAPKV_KERNEL
            ),
            lambda ratio: EvictionSpec(
                "pyramidkv", compression_ratio=ratio, window=SNAPKV_WINDOW, kernel_size=SNAPKV_KERNEL
            ),
        ),
        (
            lambda ratio: kvpress.KnormPress(compression_ratio=ratio),
            lambda ratio: EvictionSpec("key_norm", compression_ratio=ratio, window=0),
        ),
    ],
    ids=["snapkv", "pyramidkv", "key_norm"],
)
def test_scored_policy_keeps_kvpress_positions(smollm2, captured, press, spec, ratio):
    model, tokens = smollm2
    want = kvpress_kept_positions(captured, press(ratio))
    got, got_scores = jaxkv_prefill(model, tokens, spec(ratio))
    assert [layer.shape for layer in got] == [layer.shape for layer in want]  # PyramidKV: each layer's budget
    scores = kvpress_scores(captured, press(ratio))
    # The scores jaxkv kept agree with kvpress's (SnapKV's observation window is kept whatever
    # its score, which kvpress sets to the maximum + 1: left out).
    for layer, (kept, kept_scores) in enumerate(zip(got, got_scores)):
        ranked = kept < len(tokens) - spec(ratio).window
        np.testing.assert_allclose(
            kept_scores[ranked], np.take_along_axis(scores[layer], kept, axis=-1)[ranked], rtol=1e-5, atol=1e-6
        )
    problems = untied_swaps(got, want, scores)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("num_layers", [30, 2, 1])  # SmolLM2's depth, MQAR's, a one-layer model
@pytest.mark.parametrize(("window", "beta"), [(SNAPKV_WINDOW, 20), (16, 4)])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75, 0.3])  # 0.3: a fraction of the prompt that is no integer
@pytest.mark.parametrize("length", [64, 320, 1000, 2048, 301])
def test_pyramidkv_layer_budgets_are_kvpress_schedule(length, ratio, window, beta, num_layers):
    """``EvictionSpec.layer_budgets`` of a cache of ``max_length`` = the prompt's length is, layer by
    layer, ``PyramidKVPress.get_layer_budget`` of that prompt: capped first layers (320 tokens at 0.5
    on 30 layers: 256 down to 64), fallbacks to one budget (64 tokens), one layer. A budget of slots
    (the experiment grid's form) plans as the ratio that keeps as many."""
    press = kvpress.PyramidKVPress(compression_ratio=ratio, window_size=window, beta=beta)
    config = SimpleNamespace(num_hidden_layers=num_layers)
    want = [press.get_layer_budget(SimpleNamespace(config=config, layer_idx=i), length) for i in range(num_layers)]
    spec = EvictionSpec("pyramidkv", compression_ratio=ratio, window=window, beta=beta)
    assert spec.resolved(length).layer_budgets(num_layers) == want
    assert max(want) <= length
    kept = length * (1 - ratio)
    if kept.is_integer():
        slots = EvictionSpec("pyramidkv", budget=int(kept), window=window, beta=beta)
        assert slots.resolved(length).layer_budgets(num_layers) == want
