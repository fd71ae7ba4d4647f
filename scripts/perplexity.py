#!/usr/bin/env python
"""Perplexity, K/V bytes and decode speed of real models with a full-precision and each
quantized K/V cache, all read through the cache.

    python scripts/perplexity.py                                  # configs/perplexity.yaml
    python scripts/perplexity.py --config configs/perplexity-smoke.yaml

The text: the Lee background corpus (300 English news articles) that the ``gensim``
package ships as test data (``gensim/test/test_data/lee_background.cor``; gensim is
LGPL-2.1, installed with the ``test`` extra). It is tokenized by each model's own
tokenizer; a window of N + 1 tokens gives N next-token predictions.

How perplexity goes through the cache: each window is fed in chunks of ``chunk`` tokens,
each chunk a cache update followed by attention over what the cache returns, so every
prediction reads the quantized K/V of the tokens before its chunk. With ``chunk`` equal
to the residual length (128), a query sees exactly the keys decoding token by token
would (jaxkv.layers.quantized: blocks flush when the next token arrives), at the cost of a
prefill.

Decode tok/s: ``decode_tokens`` greedy single-token steps (one jitted step each) after
the window, the cache holding ~N tokens; the capacity is N + 256, so attention reads the
cache block by block.

Greedy check: ``generate`` with the CLI's default prompt (in the chat template when the
model has one; Gemma 3 270M is a base model), full precision against each ``greedy_check``
setting, ``greedy_tokens`` tokens; the first divergence is reported.

Outputs: a markdown table on stdout, ``OUT.json`` and ``OUT.png`` (``output`` in the config).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from pydantic import Field, PositiveInt

from jaxkv.app.config import QuantizationConfig, Strict, load_config
from jaxkv.app.corpus import corpus_text

class Setting(Strict):
    """One cache: a name and its quantization (None: the model's dtype)."""

    name: str
    quantization: QuantizationConfig | None = None


class PerplexityConfig(Strict):
    models: list[str] = Field(default_factory=lambda: ["smollm2", "gemma3"])
    contexts: list[PositiveInt] = Field(default_factory=lambda: [1024, 2048])
    chunk: PositiveInt = 128
    dtype: str = "float32"
    decode_tokens: PositiveInt = 32
    settings: list[Setting]
    greedy_check: list[str] = Field(
        default_factory=list
    )  # setting names compared to full precision by greedy generation
    greedy_tokens: PositiveInt = 64
    output: str = "results/perplexity"


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def score_chunk(graphdef, state, cache, tokens, targets):
    """Feed ``tokens`` ``[1, T]`` after the cache; return the summed NLL of ``targets`` ``[1, T]``."""
    model = nnx.merge(graphdef, state)
    logits, cache = model(tokens, cache.next_positions(tokens.shape[1]), cache)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.sum(jnp.take_along_axis(log_probs, targets[..., None], axis=-1)), cache


@functools.partial(jax.jit, static_argnames="graphdef", donate_argnames="cache")
def greedy_step(graphdef, state, cache, token):
    """One decode step: feed ``token`` ``[1]``, return the greedy next token and the cache."""
    model = nnx.merge(graphdef, state)
    logits, cache = model(token[:, None], cache.next_positions(1), cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


def perplexity_through_cache(model, window: np.ndarray, chunk: int, quantization=None, decode_tokens: int = 0):
    """Perplexity of ``window`` ``[N + 1]`` token ids (N predictions) fed in chunks through a
    cache, and decode tok/s of ``decode_tokens`` greedy steps after it (0: not measured).
    Returns (perplexity, decode tok/s)."""
    length = len(window) - 1
    if length % chunk:
        raise ValueError(f"the window's {length} predictions must be a multiple of the chunk {chunk}")
    cache = model.init_cache(1, length + 256, quantization=quantization)
    graphdef, state = nnx.split(model)
    total = 0.0
    for start in range(0, length, chunk):
        tokens = jnp.asarray(window[None, start : start + chunk], jnp.int32)
        targets = jnp.asarray(window[None, start + 1 : start + chunk + 1], jnp.int32)
        nll, cache = score_chunk(graphdef, state, cache, tokens, targets)
        total += float(nll)
    speed = 0.0
    if decode_tokens:
        token = jnp.asarray(window[-1:], jnp.int32)
        token, cache = jax.block_until_ready(greedy_step(graphdef, state, cache, token))  # compile
        start = time.perf_counter()
        for _ in range(decode_tokens):
            token, cache = greedy_step(graphdef, state, cache, token)
        jax.block_until_ready(token)
        speed = decode_tokens / (time.perf_counter() - start)
    return float(np.exp(total / length)), speed


def first_divergence(a, b) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def quantization_spec(setting: Setting):
    """The cache quantization of ``setting`` (None: full precision)."""
    return setting.quantization.spec() if setting.quantization else None


def context_rows(model, name: str, ids: np.ndarray, context: int, config: PerplexityConfig) -> list[dict]:
    """One row per setting for the first ``context`` predictions of ``ids``; deltas and ratios are against the first."""
    from jaxkv.memory import cache_bytes

    if len(ids) < context + 1:
        raise SystemExit(f"the corpus has {len(ids)} tokens for {name}, fewer than a {context}-token window")
    window = ids[: context + 1]
    rows, baseline = [], None
    for setting in config.settings:
        spec = quantization_spec(setting)
        start = time.perf_counter()
        ppl, speed = perplexity_through_cache(model, window, config.chunk, spec, config.decode_tokens)
        # K/V bytes of a cache sized to the window, and of the same cache in bfloat16.
        kv = cache_bytes(model.config, 1, context, jnp.dtype(config.dtype), quantization=spec)
        kv_bf16 = cache_bytes(model.config, 1, context, jnp.bfloat16, quantization=spec)
        baseline = baseline or {"ppl": ppl, "kv": kv, "kv_bf16": kv_bf16}
        row = {
            "model": name, "context": context, "setting": setting.name, "perplexity": ppl,
            "delta_pct": 100 * (ppl / baseline["ppl"] - 1), "kv_bytes": kv, "kv_ratio": kv / baseline["kv"],
            "kv_bytes_bf16": kv_bf16, "kv_ratio_bf16": kv_bf16 / baseline["kv_bf16"],
            "decode_tok_s": speed, "seconds": time.perf_counter() - start,
        }  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def greedy_checks(model, tokenizer, name: str, config: PerplexityConfig) -> list[dict]:
    """The first divergence of each ``greedy_check`` setting's greedy tokens from full precision's."""
    from jaxkv.app.cli import GenerateConfig
    from jaxkv.decoding.generate import generate

    text = GenerateConfig().prompt  # the CLI's default prompt, in the chat template if the model has one
    if tokenizer.chat_template is not None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    prompt = tokenizer.encode(text)
    full = generate(model, [prompt], max_new_tokens=config.greedy_tokens).row(0)
    greedy = []
    for setting in config.settings:
        if setting.name in config.greedy_check:
            spec = quantization_spec(setting)
            quantized = generate(model, [prompt], max_new_tokens=config.greedy_tokens, quantization=spec).row(0)
            divergence = first_divergence(full, quantized)
            greedy.append({"model": name, "setting": setting.name, "tokens": len(full), "first_divergence": divergence})
            print(json.dumps(greedy[-1]), flush=True)
    return greedy


def run(config: PerplexityConfig) -> dict:
    from jaxkv.models.load import load_pretrained

    text = corpus_text()
    rows, greedy = [], []
    for name in config.models:
        model, tokenizer = load_pretrained(name, dtype=jnp.dtype(config.dtype))
        ids = np.asarray(tokenizer.encode(text), np.int32)
        for context in config.contexts:
            rows += context_rows(model, name, ids, context, config)
        if config.greedy_check:
            greedy += greedy_checks(model, tokenizer, name, config)
    return {"rows": rows, "greedy": greedy, "config": config.model_dump(), "machine": jax.devices()[0].device_kind}


def markdown(result: dict) -> str:
    lines = [
        (
            "| model | context | cache | perplexity | delta % | KV bytes | ratio | KV bytes (bf16 cache) "
            "| ratio (bf16) | decode tok/s |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {r['context']} | {r['setting']} | {r['perplexity']:.3f} | {r['delta_pct']:+.2f} | "
            f"{r['kv_bytes'] / 2**20:.2f} MiB | {r['kv_ratio']:.3f} | {r['kv_bytes_bf16'] / 2**20:.2f} MiB | "
            f"{r['kv_ratio_bf16']:.3f} | {r['decode_tok_s']:.1f} |"
        )
    for g in result["greedy"]:
        verdict = "equal" if g["first_divergence"] is None else f"first divergence at token {g['first_divergence']}"
        lines.append(f"\nGreedy {g['tokens']} tokens, {g['model']}, {g['setting']} vs full precision: {verdict}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    panels = sorted({(r["model"], r["context"]) for r in rows})
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for axis, (model, context) in zip(axes[0], panels):
        for r in (r for r in rows if r["model"] == model and r["context"] == context):
            axis.scatter(r["kv_ratio_bf16"], r["delta_pct"], label=r["setting"])
            axis.annotate(r["setting"], (r["kv_ratio_bf16"], r["delta_pct"]), fontsize=7)
        axis.set(title=f"{model}, {context} tokens", xlabel="K/V bytes / bf16 cache", ylabel="perplexity change %")
        axis.axhline(0, color="grey", linewidth=0.5)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "perplexity.yaml")
    args = parser.parse_args(argv)
    config = load_config(args.config, PerplexityConfig)
    result = run(config)
    print(markdown(result))
    out = ROOT / config.output
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    if result["rows"]:  # a greedy-check-only run has nothing to plot
        plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')}" + (f" and {out.with_suffix('.png')}" if result["rows"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
