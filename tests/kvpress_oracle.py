"""kvpress (NVIDIA's KV-cache compression library, installed by ``bash scripts/setup.sh test``)
as the oracle for jaxkv's eviction: which positions each press keeps after a prefill.

kvpress 0.5.5 compresses in a forward hook on every attention module that reads the module's
``past_key_values`` and ``cache_position`` keywords. transformers 5.x renamed the first to
``cache`` and no longer passes the second, so under the transformers this project pins the
hook, left as it is, fails on a missing keyword. Here one prefill records what each attention
module was called with and returned (``capture_prefill``); ``kvpress_kept_positions`` then calls
kvpress's own ``forward_hook`` per layer on exactly that, with the two keywords under their old
names (``cache_position`` rebuilt from ``position_ids``: kvpress only reads it to tell a prefill),
inside the press's own context manager (its model setup). kvpress scores, keeps the top
``int(L * (1 - ratio))`` per K/V head (``PyramidKVPress``: its layer's budget) and writes the
pruned K/V into a cache holding the layer's K/V; the kept positions are read back from which keys
survived. Compression in kvpress happens after each layer's attention, so every layer sees the
uncompressed prefill, as recorded here; one recorded prefill therefore serves every press and ratio.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import transformers

from jaxkv.models.defaults import resolve_model


def load_hf_smollm2() -> transformers.PreTrainedModel:
    """SmolLM2-135M-Instruct in transformers (float32, CPU), read from the same GGUF jaxkv loads."""
    path = resolve_model("smollm2")
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


@dataclasses.dataclass(frozen=True)
class CapturedPrefill:
    """One prefill's attention calls, per layer: the keyword arguments each attention module got
    (``hidden_states`` ``[1, L, hidden]``, ``position_embeddings``, ``position_ids`` ``[1, L]``, ...),
    what it returned (``(out, weights or None)``) and its cached ``keys``/``values`` ``[1, H_kv, L, D]``."""

    model: transformers.PreTrainedModel
    kwargs: list[dict]
    outputs: list[tuple]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def capture_prefill(hf: transformers.PreTrainedModel, tokens) -> CapturedPrefill:
    """Prefill ``tokens`` (one row of ids) and record every attention module's call."""
    num_layers = hf.config.num_hidden_layers
    calls: dict[int, tuple[dict, tuple]] = {}

    def record(module, args, kwargs, output):
        calls[module.layer_idx] = (kwargs, output)

    cache = transformers.DynamicCache(config=hf.config)
    hooks = [layer.self_attn.register_forward_hook(record, with_kwargs=True) for layer in hf.model.layers]
    try:
        with torch.no_grad():
            hf(torch.tensor([list(tokens)]), cache=cache, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    if sorted(calls) != list(range(num_layers)):
        raise AssertionError(f"attention ran on layers {sorted(calls)}, expected all {num_layers}")
    return CapturedPrefill(
        model=hf,
        kwargs=[calls[i][0] for i in range(num_layers)],
        outputs=[calls[i][1] for i in range(num_layers)],
        keys=[cache.layers[i].keys for i in range(num_layers)],
        values=[cache.layers[i].values for i in range(num_layers)],
    )


def _kept_positions(full_keys: torch.Tensor, kept_keys: torch.Tensor) -> np.ndarray:
    """Positions ``[H_kv, n_kept]`` (sorted) of the kept keys ``[1, H_kv, n_kept, D]`` in the
    uncompressed ``[1, H_kv, L, D]``: kvpress gathers, so each kept key is bit-for-bit one row."""
    kept = []
    for full, pruned in zip(full_keys[0].numpy(), kept_keys[0].numpy()):
        position_of = {row.tobytes(): position for position, row in enumerate(full)}
        if len(position_of) != len(full):
            raise AssertionError("two positions of one head hold the same key: kept keys cannot name positions")
        kept.append(sorted(position_of[row.tobytes()] for row in pruned))
    return np.asarray(kept)


def kvpress_kept_positions(captured: CapturedPrefill, press) -> list[np.ndarray]:
    """The positions kvpress's ``press`` (e.g. ``kvpress.SnapKVPress(compression_ratio=0.5)``)
    keeps of the ``captured`` prefill: per layer ``[H_kv, n_kept]`` int, sorted along the last axis
    (``n_kept`` differs by layer under ``PyramidKVPress``)."""
    kept = []
    with torch.no_grad(), press(captured.model):
        for i, module in enumerate(layer.self_attn for layer in captured.model.model.layers):
            cache = transformers.DynamicCache(config=captured.model.config)
            cache.update(captured.keys[i], captured.values[i], i)
            kwargs = captured.kwargs[i]
            legacy = {**kwargs, "past_key_values": cache, "cache_position": kwargs["position_ids"][0]}
            press.forward_hook(module, (), legacy, captured.outputs[i])
            kept.append(_kept_positions(captured.keys[i], cache.layers[i].keys))
    return kept


def kvpress_scores(captured: CapturedPrefill, press) -> np.ndarray:
    """kvpress's ``press.score`` of every position of the ``captured`` prefill: ``[num_layers,
    H_kv, L]`` float64 (higher is kept), what its top-k ranks."""
    scores = []
    with torch.no_grad(), press(captured.model):
        for i, module in enumerate(layer.self_attn for layer in captured.model.model.layers):
            kwargs = captured.kwargs[i]
            hidden, attentions = kwargs["hidden_states"], captured.outputs[i][1]
            score = press.score(module, hidden, captured.keys[i], captured.values[i], attentions, kwargs)
            scores.append(score[0].double().numpy())
    return np.stack(scores)
