#!/usr/bin/env python
"""Decode benchmark: jaxkv (static and dynamic cache) against transformers (dynamic and static cache)
and llama.cpp (on the same GGUF file).

    jaxkv bench decode                                   # smollm2, batch 1 and 8, 32 + 256 tokens
    jaxkv bench decode --batch 1 --new-tokens 8 --prompt-tokens 16 --out results/smoke
    jaxkv bench decode --long                            # + the 4k vs 32k cache capacity experiment
    jaxkv bench decode --systems jaxkv-static llama.cpp llama.cpp-1-thread --weights gguf --repeat 3

Every configuration (system x cache x batch) runs in a fresh subprocess (this module again,
``python -m jaxkv.bench.decode`` with a hidden ``--worker SPEC`` argument: ``jaxkv.bench.common``'s
``run_worker``), so its peak RSS and its compile caches are its own. All configurations use the
same model file, the same prompt (a fixed English text tokenized by the model's tokenizer, cut or
repeated to ``--prompt-tokens``, the same for every row) and generate exactly ``--new-tokens``
tokens per row, greedily, with no stop token.

Every system gets a warm-up: jaxkv calls ``generate`` twice in its process, the first call
(cold: it compiles) gives compile s and TTFT, the second the rates; transformers and llama.cpp
run a 2-token generation first.

``llama.cpp`` and ``llama.cpp-1-thread`` (run only when named): llama.cpp (llama-cpp-python built
from source for this CPU in its own venv, ``jaxkv.bench.llama_cpp_env``; made on first use, several
minutes) on the model's GGUF file itself, its K/V cache f16 (llama.cpp's default), through its C
API's batch interface: B sequences in one context, one ``llama_decode`` a step, llama.cpp's greedy
sampler (``jaxkv.bench.llama_cpp_worker``). Threads: ``--threads`` (default: the CPUs jaxkv uses)
for ``llama.cpp``, 1 for ``llama.cpp-1-thread``. A model that is not a GGUF file gives those rows
an error instead.

``--weights`` (jaxkv only): how ``load_pretrained`` holds the matrices (``weights=``: dense, gguf
for the GGUF file's own blocks, int8, int4); by default the loader's own default.

What is measured, per configuration:

* prefill tok/s = prompt tokens x batch / prefill seconds. jaxkv: ``Generation.prefill_seconds``
  (the compiled prefill call). transformers: from the ``generate`` call's start to the first
  logits-processor call (the prefill forward, input preparation and cache creation included).
* decode tok/s = batch x (new tokens - 1) / decode seconds: the first token comes from the
  prefill, the other new - 1 from decode steps. transformers: from the first logits-processor
  call to the end of ``generate``.
* compile s: jaxkv ``Generation.compile_seconds`` (prefill and decode); transformers 0
  (``generate`` compiles nothing on CPU).
* TTFT s (time to first token, cold): jaxkv compile + prefill of the first call (an
  over-estimate: it includes the decode loop's compile, which in fact happens after the
  first token). transformers: the first ``generate`` call in the fresh process (a 2-token
  warm-up), from its start to its first logits-processor call; the measured run comes
  after that warm-up.
* peak RSS MiB: ``ru_maxrss`` of the worker process (model loading included).
* cache MiB: jaxkv ``Generation.cache_bytes``; transformers the K/V tensors of the returned cache.

Plus a memory-bandwidth bound for batch-1 decode: (parameter bytes + K/V bytes of the live
context, averaged over the decode) / bandwidth, where the bandwidth is the best of a timed
numpy copy and a jitted jax sum over a large array, measured in its own worker. And, per row,
the bytes its decode step reads: its own weights (jaxkv: the loaded parameters' bytes, the kept
blocks with ``--weights gguf``; llama.cpp: the file's tensors; transformers: its parameters) and
the live K/V of every row in its own cache's type; the GB/s that streams at the row's decode
rate, and that as a fraction of the measured bandwidth.

``--quantized`` (jaxkv only): the quantized K/V formats of ``configs/experiments/perplexity.yaml``
against full precision, batch 1, at a ``--quantized-context``-token context (random ids):
decode ms/step after prefilling it, and the seconds of one perplexity window of that length fed
in 128-token chunks (what ``jaxkv experiment`` runs); target: every format within 1.5x of full
precision on both.

``--device gpu``: both systems on the GPU (jaxkv with ``JAX_PLATFORMS=cuda``, transformers on
``cuda``, its static cache compiled by ``generate`` itself with ``torch.compile``); the bound is
then the HBM bandwidth a jitted jax sum reaches. It needs a jax with CUDA (``pip install
"jax[cuda12]"``) and a CUDA torch; without a GPU it stops with an error saying so.

``--long`` (jaxkv only): a prompt of 4096 random token ids, 32 new tokens, static cache with the
capacity ``generate`` picks by default (bucket(bucket(4096) + 32) = 8192) against 32768; reports
decode ms/step for each and their ratio (target <= 1.25). ``--long-prompt``/``--long-capacity``
shrink it for smoke runs.

Outputs: a markdown table and the targets on stdout, ``OUT.json`` and ``OUT.png`` (``--out``).
Timings are only meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jaxkv.bench import llama_cpp_worker
from jaxkv.bench.bandwidth import measure_bandwidth
from jaxkv.bench.common import (
    DEVICES, TINY, TINY_CONFIG, cpu_cores, environment, fmt, hf_model, hf_sizes, jaxkv_model, jaxkv_sizes,
    median_run, print_targets, run_as_worker, run_worker,
)  # fmt: skip
from jaxkv.bench.llama_cpp_env import VENV as LLAMA_CPP_VENV
from jaxkv.bench.llama_cpp_env import LlamaCppUnavailable, ensure_venv

MODULE = "jaxkv.bench.decode"  # workers run as `python -m MODULE --worker SPEC`
# name -> (system, cache kind, options: jaxkv's model options, llama.cpp's worker settings); the order is the table's.
CONFIGS = {
    "jaxkv-static": ("jaxkv", "static", {}),
    "jaxkv-in-out": ("jaxkv", "static", {"weight_layout": "in_out"}),  # scanned, [in, out] matrices: slices copied
    "jaxkv-dynamic": ("jaxkv", "dynamic", {}),
    "jaxkv-unrolled": ("jaxkv", "static", {"scan_layers": False}),  # one weight buffer per layer, no slice copies
    "hf-dynamic": ("transformers", "dynamic", None),
    "hf-static": ("transformers", "static", None),
    "llama.cpp": ("llama.cpp", "static f16", {}),  # --threads threads
    "llama.cpp-1-thread": ("llama.cpp", "static f16", {"threads": 1}),
}
NAMED_ONLY = ("llama.cpp", "llama.cpp-1-thread")  # not run unless named: the first use builds llama.cpp (minutes)
SYSTEM_LABELS = {"jaxkv-in-out": "jaxkv [in, out] weights", "jaxkv-unrolled": "jaxkv unrolled",
                 "llama.cpp-1-thread": "llama.cpp, 1 thread"}  # fmt: skip
BASELINE = "hf-dynamic"
TARGET_LLAMA_CPP = 1.0  # b1 decode tok/s of jaxkv-static / llama.cpp's, on the same file
TARGET_BOUND_FRACTION = 0.85  # b1 decode of jaxkv-static: GB/s streamed / the measured bandwidth
TARGET_SPEEDUP = {1: 2.5, 8: 2.0}  # batch -> jaxkv decode tok/s / HF dynamic decode tok/s
TARGET_TTFT_S = 10.0
TARGET_LONG_RATIO = 1.25
TARGET_QUANTIZED_RATIO = 1.5
# --quantized: the formats of configs/experiments/perplexity.yaml (QuantSpec keywords; KIVI: keys
# per channel, values per token, groups of 64, a 128-token residual).
QUANTIZED_FORMATS = {
    "full": None,
    "int8": dict(nbits=8),
    "int4-kivi": dict(nbits=4, axis_key=-1, axis_value=0, q_group_size=64, residual_length=128),
    "int2-kivi": dict(nbits=2, axis_key=-1, axis_value=0, q_group_size=64, residual_length=128),
    "fp8-e4m3": dict(format="e4m3"),
    "fp8-e5m2": dict(format="e5m2"),
}
PERPLEXITY_CHUNK = 128

PROMPT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
    "produce books far faster than any scribe. Within a few decades, printing shops had opened in "
    "most of the large cities of Europe, and the price of books fell sharply. Scholars could now "
    "compare identical copies of a text, merchants printed price lists and maps, and pamphlets "
    "spread news and arguments to readers who had never owned a book before. Historians still "
    "debate how much the press changed the way people thought, but few doubt that it changed how "
    "quickly ideas could travel from one town to the next."
)


# ----------------------------------------------------------------------------------------------
# helpers shared by parent and workers


def bucket(n: int) -> int:
    from jaxkv.sizing import bucket as jaxkv_bucket

    return jaxkv_bucket(n)


def prompt_ids(model: str, num_tokens: int) -> list[int]:
    """``PROMPT_TEXT`` tokenized by the model's tokenizer, repeated and cut to ``num_tokens``."""
    if model == TINY:
        ids = [(7 * i + 3) % TINY_CONFIG["vocab_size"] for i in range(64)]
    else:
        from jaxkv.models.defaults import resolve_model
        from jaxkv.models.tokenizer import Tokenizer

        path = resolve_model(model)
        if path.suffix == ".gguf":
            tokenizer = Tokenizer.from_gguf(path)
        else:
            config = path / "tokenizer_config.json"
            tokenizer = Tokenizer.from_file(path / "tokenizer.json", config if config.is_file() else None)
        ids = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def random_ids(vocab_size: int, num_tokens: int, seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab_size, num_tokens).tolist()


# ----------------------------------------------------------------------------------------------
# workers: each runs in its own process and returns a dict


def worker_jaxkv(spec: dict) -> dict:
    """One ``generate`` call; with ``spec['long']`` the prompt is random ids of ``spec['prompt_tokens']``."""
    import jax
    import numpy as np

    import jaxkv.decoding.generate  # noqa: F401  imported before the load timer: load_s times the model alone

    start = time.perf_counter()
    model = jaxkv_model(spec["model"], spec["dtype"], **spec["model_kwargs"])
    load_seconds = time.perf_counter() - start
    new = spec["new_tokens"]
    prompt = spec.get("prompt") or random_ids(model.config.vocab_size, spec["prompt_tokens"])
    capacity = spec.get("max_length") or bucket(bucket(len(prompt)) + new)  # what generate picks when None
    cold = _jaxkv_generate(model, prompt, spec)  # compiles: TTFT and compile time; transformers gets its warm-up too
    result = _jaxkv_generate(model, prompt, spec)  # the measured run, on the compiled executables
    _check_jaxkv_runs(cold, result, new)
    return dict(
        prefill_s=result.prefill_seconds,
        decode_s=result.decode_seconds,
        compile_s=cold.compile_seconds,
        ttft_s=cold.compile_seconds + cold.prefill_seconds,
        cache_bytes=int(result.cache_bytes),
        **jaxkv_sizes(model, spec["dtype"]),
        capacity=capacity if spec["cache"] == "static" else None,
        load_s=load_seconds,
        tokens_head=result.tokens[0, :16].tolist(),
        rows_identical=bool(np.all(result.tokens == result.tokens[:1])),
        backend=jax.default_backend(),
    )


def _jaxkv_generate(model, prompt: list[int], spec: dict, **cache_settings):
    """``spec['batch']`` copies of ``prompt``, exactly ``spec['new_tokens']`` greedy tokens each;
    ``cache_settings`` for ``model.init_cache`` (``quantization``)."""
    from jaxkv.decoding.generate import generate
    from jaxkv.decoding.sampling import Sampling

    return generate(
        model,
        [prompt] * spec["batch"],
        max_new_tokens=spec["new_tokens"],
        stop_tokens=(),
        sampling=Sampling(),  # greedy
        full_attention=spec["cache"],
        max_length=spec.get("max_length"),
        **cache_settings,
    )


def _check_jaxkv_runs(cold, result, new: int) -> None:
    """Both greedy runs must give the same tokens, and every row exactly ``new`` of them."""
    import numpy as np

    if not np.array_equal(cold.tokens, result.tokens):
        raise RuntimeError("jaxkv's two greedy runs of the same prompts gave different tokens")
    if not np.all(result.num_generated == new):
        raise RuntimeError(f"jaxkv generated {result.num_generated.tolist()} tokens, expected {new} per row")


def worker_quantized(spec: dict) -> dict:
    """One ``--quantized`` format: ``generate`` after a ``spec['prompt_tokens']``-token prompt of
    random ids (twice; the second call is timed) and one perplexity window of that length in
    ``PERPLEXITY_CHUNK``-token updates (twice; the second is timed)."""
    import jax
    import numpy as np

    from jaxkv.research.tasks import perplexity_through_cache
    from jaxkv.quantization import QuantSpec

    model = jaxkv_model(spec["model"], spec["dtype"])
    options = {} if spec["quantization"] is None else {"quantization": QuantSpec(**spec["quantization"])}
    prompt = random_ids(model.config.vocab_size, spec["prompt_tokens"])
    spec = spec | {"prompt": prompt, "cache": "static", "batch": 1}
    cold, result = (_jaxkv_generate(model, prompt, spec, **options) for _ in range(2))
    _check_jaxkv_runs(cold, result, spec["new_tokens"])
    window = np.asarray(random_ids(model.config.vocab_size, spec["prompt_tokens"] + 1, seed=1))[None]
    window_s = []
    for _ in range(2):  # the first compiles
        start = time.perf_counter()
        perplexity, _ = perplexity_through_cache(model, window, PERPLEXITY_CHUNK, options)
        window_s.append(time.perf_counter() - start)
    return dict(
        prefill_s=result.prefill_seconds, decode_s=result.decode_seconds, window_s=window_s[1],
        cache_bytes=int(result.cache_bytes), perplexity=float(perplexity[0]),
        tokens_head=result.tokens[0, :16].tolist(), backend=jax.default_backend(),
    )  # fmt: skip


def _hf_cache_bytes(cache) -> int:
    if cache is None:
        return 0
    tensors = []
    if hasattr(cache, "layers"):  # transformers >= 4.56
        for layer in cache.layers:
            tensors += [getattr(layer, "keys", None), getattr(layer, "values", None)]
    else:
        tensors += list(getattr(cache, "key_cache", [])) + list(getattr(cache, "value_cache", []))
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None and hasattr(t, "numel")))


def worker_transformers(spec: dict) -> dict:
    import torch
    import transformers  # noqa: F401  imported before the load timer: load_s times the model alone

    torch.set_num_threads(spec["threads"])
    device = "cuda" if spec.get("device") == "gpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device gpu: torch sees no CUDA device (a CUDA build of torch and a GPU are needed)")
    start = time.perf_counter()
    model = hf_model(spec["model"], spec["dtype"]).to(device)
    load_seconds = time.perf_counter() - start
    new = spec["new_tokens"]
    ids = torch.tensor([spec["prompt"]] * spec["batch"], dtype=torch.long, device=device)
    # On a GPU the static cache's generate compiles its forward (torch.compile) for the cache's
    # length: the warm-up runs the measured length, so the measured run compiles nothing.
    warmup = new if device == "cuda" else min(2, new)
    _, start, times, _ = _hf_generate(model, ids, spec["cache"], warmup)  # the cold first call
    ttft = times[0] - start
    out, start, times, end = _hf_generate(model, ids, spec["cache"], new)
    generated = out.sequences.shape[1] - ids.shape[1]
    if generated != new or len(times) != new:
        raise RuntimeError(f"transformers generated {generated} tokens ({len(times)} steps), expected {new}")
    cache = out.get("cache") if "cache" in out else out.get("past_key_values")
    sequences = out.sequences[:, ids.shape[1] :]
    return dict(
        prefill_s=times[0] - start,
        decode_s=end - times[0],
        compile_s=0.0,
        ttft_s=ttft,
        cache_bytes=_hf_cache_bytes(cache),
        **hf_sizes(model),
        load_s=load_seconds,
        tokens_head=sequences[0, :16].tolist(),
        rows_identical=bool(torch.all(sequences == sequences[:1]).item()),
        threads=torch.get_num_threads(),
    )


def _hf_step_timer():
    """A logits processor that records ``time.perf_counter()`` in ``.times`` at each call."""
    import torch
    import transformers

    class StepTimes(transformers.LogitsProcessor):
        """Called once per generated token, right after the forward that produced its logits."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            if scores.is_cuda:  # the step's kernels are queued: time their end
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    return StepTimes()


def _hf_generate(model, ids, cache: str, max_new_tokens: int):
    """Greedy ``generate`` of exactly ``max_new_tokens``: (output, start time, per-step times, end time)."""
    import torch
    import transformers

    timer = _hf_step_timer()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=None,
            pad_token_id=0,
            cache_implementation="static" if cache == "static" else None,
            return_dict_in_generate=True,
            logits_processor=transformers.LogitsProcessorList([timer]),
        )
    if ids.is_cuda:
        torch.cuda.synchronize()
    end = time.perf_counter()
    return out, start, timer.times, end


def run_spec(spec: dict) -> dict:
    """A worker's configuration: the ``--quantized`` experiment's, jaxkv's or transformers' ``generate``."""
    if spec["kind"] == "quantized":
        return worker_quantized(spec)
    return worker_jaxkv(spec) if spec["system"] == "jaxkv" else worker_transformers(spec)


# ----------------------------------------------------------------------------------------------
# parent


def add_rates(row: dict) -> None:
    if "error" in row:
        return
    batch, new = row["batch"], row["new_tokens"]
    row["prefill_tok_s"] = row["prompt_tokens"] * batch / row["prefill_s"]
    row["decode_tok_s"] = batch * (new - 1) / row["decode_s"]
    row["decode_ms_per_step"] = 1000 * row["decode_s"] / (new - 1)


def decode_cell(row: dict) -> str:
    """Decode tok/s; over several runs the median, then (min-max)."""
    runs = row.get("decode_tok_s_runs", [])
    spread = f" ({runs[0]:.1f}-{runs[-1]:.1f})" if len(runs) > 1 else ""
    return fmt(row["decode_tok_s"]) + spread


def markdown_table(rows: list[dict]) -> str:
    header = [
        "system", "cache", "batch", "prefill tok/s", "decode tok/s (min-max)", "compile s", "TTFT s",
        "peak RSS MiB", "cache MiB", "speed-up vs HF dynamic",
    ]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|"]
    for row in rows:
        system = SYSTEM_LABELS.get(row["name"], row["system"])
        if "error" in row:
            cells = [system, row["cache"], str(row["batch"]), f"failed: {row['error'][:60]}"] + ["-"] * 6
        else:
            speedup = row.get("speedup_vs_hf_dynamic")
            cells = [
                system, row["cache"], str(row["batch"]), fmt(row["prefill_tok_s"]), decode_cell(row),
                fmt(row["compile_s"], ".2f"), fmt(row["ttft_s"], ".2f"), fmt(row["peak_rss_mib"], ".0f"),
                fmt(row["cache_bytes"] / 2**20, ".2f"), "-" if speedup is None else f"{speedup:.2f}x",
            ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_targets(rows: list[dict], long: dict | None) -> list[dict]:
    """Each target with its value, its display and whether it passed (None: not measured)."""
    ok = [r for r in rows if "error" not in r]
    targets = speedup_targets(ok) + ttft_targets(ok) + llama_cpp_targets(ok)
    if long is not None:
        targets.append(long_target(long))
    return targets


def speedup_targets(ok: list[dict]) -> list[dict]:
    find = lambda name, batch: next((r for r in ok if r["name"] == name and r["batch"] == batch), None)  # noqa: E731
    targets = []
    for batch, factor in TARGET_SPEEDUP.items():
        for name in ("jaxkv-static", "jaxkv-in-out", "jaxkv-dynamic", "jaxkv-unrolled"):
            row = find(name, batch)
            value = row.get("speedup_vs_hf_dynamic") if row else None
            targets.append(
                dict(
                    target=f"b{batch} decode {name} >= {factor}x HF dynamic",
                    value=value,
                    display="not measured" if value is None else f"{value:.2f}x",
                    passed=None if value is None else value >= factor,
                )
            )
    return targets


def ttft_targets(ok: list[dict]) -> list[dict]:
    return [
        dict(
            target=f"TTFT {row['name']} b{row['batch']} <= {TARGET_TTFT_S:g} s (compile + prefill)",
            value=row["ttft_s"],
            display=f"{row['ttft_s']:.2f} s",
            passed=row["ttft_s"] <= TARGET_TTFT_S,
        )
        for row in ok
        if row["system"] == "jaxkv"
    ]


def llama_cpp_targets(ok: list[dict]) -> list[dict]:
    """With a batch-1 ``llama.cpp`` row: jaxkv-static's b1 decode against it, and against the bandwidth
    its own bytes need (``decode_bytes``' fraction)."""
    llama_cpp = next((r for r in ok if r["name"] == "llama.cpp" and r["batch"] == 1), None)
    jaxkv = next((r for r in ok if r["name"] == "jaxkv-static" and r["batch"] == 1), None)
    if llama_cpp is None:
        return []
    ratio = None if jaxkv is None else jaxkv["decode_tok_s"] / llama_cpp["decode_tok_s"]
    fraction = None if jaxkv is None else jaxkv["bytes"]["fraction_of_bandwidth"]
    return [
        dict(target=f"b1 decode jaxkv-static >= {TARGET_LLAMA_CPP:g}x llama.cpp ({llama_cpp['threads']} threads), "
             "same file", value=ratio, display="not measured" if ratio is None else f"{ratio:.2f}x",
             passed=None if ratio is None else ratio >= TARGET_LLAMA_CPP),
        dict(target=f"b1 decode jaxkv-static streams >= {TARGET_BOUND_FRACTION:.0%} of the measured bandwidth "
             "(its own bytes per step)", value=fraction,
             display="not measured" if fraction is None else f"{fraction:.1%}",
             passed=None if fraction is None else fraction >= TARGET_BOUND_FRACTION),
    ]  # fmt: skip


def long_target(long: dict) -> dict:
    ratio = long.get("ratio")
    return dict(
        target=f"long: decode ms/step at capacity {long['large_capacity']} / at {long['small_capacity']} "
        f"<= {TARGET_LONG_RATIO}",
        value=ratio,
        display="failed" if ratio is None else f"{ratio:.3f}",
        passed=None if ratio is None else ratio <= TARGET_LONG_RATIO,
    )


def bandwidth_bound(rows: list[dict], membw: dict, prompt_tokens: int, new_tokens: int) -> dict | None:
    """Batch-1 decode tokens/s if every step only had to read the weights and the live K/V once: a
    jaxkv row's (else the first row's) bytes, and the batch-1 rows of the same weight bytes as a
    fraction of it."""
    if "error" in membw:
        return None
    ok = [r for r in rows if "error" not in r]
    source = next((r for r in ok if r["system"] == "jaxkv"), None) or next(iter(ok), None)
    if source is None:
        return None
    kv_bytes = source["kv_bytes_per_token"] * (prompt_tokens + new_tokens / 2)  # average live context
    step_bytes = source["param_bytes"] + kv_bytes
    bound = dict(
        bandwidth_gbps=membw["gbps"],
        numpy_copy_gbps=membw["numpy_copy_gbps"],
        jax_sum_gbps=membw["jax_sum_gbps"],
        param_bytes=source["param_bytes"],
        kv_bytes=kv_bytes,
        bytes_per_step=step_bytes,
        tok_s_upper_bound_b1=membw["gbps"] * 1e9 / step_bytes,
    )
    static = next((r for r in ok if r["name"] == "jaxkv-static" and r["batch"] == 1), None)
    if static:  # the static decode reads its whole preallocated buffer
        allocated = source["param_bytes"] + static["cache_bytes"]
        bound["tok_s_upper_bound_b1_allocated_cache"] = membw["gbps"] * 1e9 / allocated
    for row in ok:  # the rows reading the same weights (each row's own bytes: decode_bytes)
        if row["batch"] == 1 and row["param_bytes"] == source["param_bytes"]:
            bound[f"fraction_of_bound_{row['name']}"] = row["decode_tok_s"] / bound["tok_s_upper_bound_b1"]
    return bound


def decode_bytes(row: dict, gbps: float | None) -> dict:
    """What one decode step of ``row`` reads: its weights (``param_bytes``) and every row's live K/V
    (its ``kv_bytes_per_token`` x the average context, prompt + new / 2); per token (/ batch); the
    GB/s that streams at the row's decode rate, as a fraction of ``gbps`` (the measured
    bandwidth; None: not measured), and the decode tok/s ``gbps`` would allow those bytes."""
    kv = row["kv_bytes_per_token"] * (row["prompt_tokens"] + row["new_tokens"] / 2) * row["batch"]
    step = row["param_bytes"] + kv
    streamed = step * (row["new_tokens"] - 1) / row["decode_s"] / 1e9
    return dict(
        weight_bytes=row["param_bytes"], kv_bytes=kv, bytes_per_step=step, bytes_per_token=step / row["batch"],
        streamed_gbps=streamed, fraction_of_bandwidth=None if gbps is None else streamed / gbps,
        tok_s_bound=None if gbps is None else gbps * 1e9 / step * row["batch"],
    )  # fmt: skip


def bytes_table(rows: list[dict]) -> str:
    """The bytes each successful row's decode step reads (``row['bytes']``), against the bandwidth."""
    header = ["system", "batch", "weights MiB", "live K/V MiB", "MiB / token", "decode tok/s", "GB/s streamed",
              "of measured bandwidth", "tok/s bound"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for row in rows:
        if "error" in row:
            continue
        b = row["bytes"]
        cells = [
            SYSTEM_LABELS.get(row["name"], row["system"]), str(row["batch"]), fmt(b["weight_bytes"], ".1f", 2**-20),
            fmt(b["kv_bytes"], ".2f", 2**-20), fmt(b["bytes_per_token"], ".1f", 2**-20), fmt(row["decode_tok_s"]),
            fmt(b["streamed_gbps"]), fmt(b["fraction_of_bandwidth"], ".1%"), fmt(b["tok_s_bound"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def agreement(rows: list[dict]) -> dict:
    """For each batch: how many leading greedy tokens of row 0 each config shares with jaxkv-static."""
    result = {}
    for row in rows:
        ref = next((r for r in rows if r["name"] == "jaxkv-static" and r["batch"] == row["batch"]), None)
        if "error" in row or ref is None or "error" in ref or row is ref:
            continue
        same = 0
        for a, b in zip(ref["tokens_head"], row["tokens_head"]):
            if a != b:
                break
            same += 1
        result[f"{row['name']} b{row['batch']}"] = f"{same}/{min(len(ref['tokens_head']), len(row['tokens_head']))}"
    return result


def plot(rows: list[dict], long: dict | None, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    names = [n for n in CONFIGS if any(r["name"] == n for r in ok)]
    batches = sorted({r["batch"] for r in ok})
    panels = 2 if long and long.get("ratio") is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 + 2 * len(batches) + 4 * (panels - 1), 4.5), squeeze=False)
    ax = axes[0, 0]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        values = [next((r["decode_tok_s"] for r in ok if r["name"] == name and r["batch"] == b), 0.0) for b in batches]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(batches))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("decode tokens/s")
    ax.set_title(title, fontsize=9)
    if names:
        ax.legend(fontsize=8)
    if panels == 2:
        ax = axes[0, 1]
        labels = [f"capacity {long['small_capacity']}", f"capacity {long['large_capacity']}"]
        bars = ax.bar(labels, [long["small"]["decode_ms_per_step"], long["large"]["decode_ms_per_step"]], color="C0")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_ylabel("decode ms/step (jaxkv static, batch 1)")
        ax.set_title(f"prompt {long['prompt_tokens']} random ids: ratio {long['ratio']:.2f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="default model name, .gguf file or checkpoint directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both systems")
    parser.add_argument("--systems", nargs="+", choices=list(CONFIGS),
                        default=[name for name in CONFIGS if name not in NAMED_ONLY],
                        help=f"default: all but {', '.join(NAMED_ONLY)} (run only when named)")  # fmt: skip
    parser.add_argument("--weights", metavar="KIND", help="jaxkv's load_pretrained(weights=KIND): dense, gguf "
                        "(the GGUF's own blocks), int8, int4; default: the loader's")  # fmt: skip
    parser.add_argument("--llama-cpp-venv", type=Path, default=LLAMA_CPP_VENV, help="llama.cpp's venv (made on "
                        "first use)")  # fmt: skip
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where both systems run")
    parser.add_argument("--quantized", action="store_true", help="also run the quantized K/V experiment")
    parser.add_argument("--quantized-context", type=int, default=1024, help="--quantized context (random ids)")
    parser.add_argument("--quantized-new-tokens", type=int, default=64)
    parser.add_argument("--quantized-formats", nargs="+", choices=list(QUANTIZED_FORMATS)[1:],
                        default=list(QUANTIZED_FORMATS)[1:], help="--quantized formats (full precision always runs)")
    parser.add_argument("--long", action="store_true", help="also run the jaxkv cache-capacity experiment")
    parser.add_argument("--long-prompt", type=int, default=4096, help="--long prompt length (random ids)")
    parser.add_argument("--long-new-tokens", type=int, default=32)
    parser.add_argument("--long-capacity", type=int, default=32768, help="--long large cache capacity")
    parser.add_argument("--membw-mib", type=int, default=512, help="array size for the bandwidth measurement")
    parser.add_argument("--threads", type=int, default=cpu_cores(),
                        help="torch's and llama.cpp's threads (default: the usable cores, as jaxkv)")  # fmt: skip
    parser.add_argument("--worker-timeout", type=float, default=None, help="seconds per configuration")
    parser.add_argument("--out", type=Path, default=Path("results/bench"), help="writes OUT.json and OUT.png")
    parser.add_argument(
        "--repeat", type=int, default=1, help="fresh worker runs per configuration; rows show the median, min-max"
    )
    parser.add_argument("--verbose", action="store_true", help="show the workers' output")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--"]:  # `jaxkv bench -- --batch 1 8`: the CLI passes the separator through
        argv = argv[1:]
    args = parser.parse_args(argv)
    if args.worker is None:
        if min(args.new_tokens, args.long_new_tokens, args.quantized_new_tokens) < 2:
            parser.error("--new-tokens, --long-new-tokens and --quantized-new-tokens must be at least 2 (decode rate "
                         "needs a decode step)")  # fmt: skip
        if args.prompt_tokens < 1 or args.long_prompt < 1 or min(args.batch) < 1:
            parser.error("--prompt-tokens, --long-prompt and --batch must be positive")
        if args.quantized_context < PERPLEXITY_CHUNK or args.quantized_context % PERPLEXITY_CHUNK:
            parser.error(f"--quantized-context must be a positive multiple of {PERPLEXITY_CHUNK} (the window's chunks)")
        llama_cpp = [name for name in args.systems if CONFIGS[name][0] == "llama.cpp"]
        if args.device == "gpu" and llama_cpp:
            parser.error(f"--device gpu: {', '.join(llama_cpp)} run llama.cpp's CPU build; leave them out")
    return args


def run_config(args, spec: dict, command: list[str] | None = None) -> dict:
    """``spec`` run by a fresh worker: ``command`` (its spec file follows), by default this module again."""
    command = command or [sys.executable, "-m", MODULE, "--worker"]
    return run_worker(command, spec, label=spec["label"], device=spec["device"], timeout=args.worker_timeout,
                      verbose=args.verbose)  # fmt: skip


def repeated(args, spec: dict, command: list[str] | None = None, **fields) -> dict:
    """``--repeat`` fresh workers of ``spec`` (run by ``command``, as ``run_config``), each result with
    ``fields`` and its rates: the run of median decode speed, with every successful run's decode
    tok/s in ``decode_tok_s_runs`` (sorted); the first failure if none ran."""
    runs = []
    for _ in range(args.repeat):
        row = dict(fields, **run_config(args, spec, command))
        add_rates(row)
        runs.append(row)
    middle = median_run(runs, "decode_tok_s")
    if middle is None:
        return runs[0]
    return middle | {"decode_tok_s_runs": sorted(r["decode_tok_s"] for r in runs if "error" not in r)}


def llama_cpp_setup(args) -> tuple[list[str] | None, str | None]:
    """With a llama.cpp system in ``--systems``: the command that runs its worker (the python of its
    venv, made on first use, and ``llama_cpp_worker.py``) and None; or None and why its rows do not
    run (the model is not a GGUF file, the venv could not be made). (None, None) without one."""
    if not any(CONFIGS[name][0] == "llama.cpp" for name in args.systems):
        return None, None
    path = gguf_path(args.model)
    if path is None:
        return None, f"llama.cpp runs a GGUF file; --model {args.model} is not one"
    try:
        python = ensure_venv(args.llama_cpp_venv)
    except LlamaCppUnavailable as error:
        print(f"[bench] llama.cpp is unavailable: {error}", file=sys.stderr, flush=True)
        return None, f"llama.cpp unavailable: {error}"
    return [str(python), str(Path(llama_cpp_worker.__file__))], None


def gguf_path(model: str) -> Path | None:
    """The GGUF file ``model`` names (a default name or a path), or None when it names none."""
    if model == TINY:
        return None
    from jaxkv.models.defaults import resolve_model

    path = resolve_model(model)
    return path if path.suffix == ".gguf" else None


def run_configurations(args, prompt: list[int], common: dict) -> list[dict]:
    """One row per batch x ``--systems`` configuration, the median of ``--repeat`` workers (fresh
    processes: a bimodal path shows as min/max), with its speed-up over HF dynamic. A jaxkv
    configuration loads with ``--weights`` when given; a llama.cpp one runs the model's GGUF file
    (or is an error row saying why it did not run)."""
    llama_cpp, skipped = llama_cpp_setup(args)
    weights = {} if args.weights is None else {"weights": args.weights}
    rows = []
    for batch in args.batch:
        for name in args.systems:
            system, cache, options = CONFIGS[name]
            fields = dict(name=name, system=system, cache=cache, batch=batch, prompt_tokens=len(prompt),
                          new_tokens=args.new_tokens)  # fmt: skip
            spec = dict(kind="generate", system=system, cache=cache, batch=batch, prompt=prompt,
                        new_tokens=args.new_tokens, label=f"{name} batch {batch}", **common)  # fmt: skip
            if system == "llama.cpp" and skipped:
                rows.append(fields | dict(error=skipped))
            elif system == "llama.cpp":
                spec |= dict(model_path=str(gguf_path(args.model)), **options)
                rows.append(repeated(args, spec, llama_cpp, **fields))
            else:
                rows.append(repeated(args, spec | dict(model_kwargs=None if options is None else options | weights),
                                     **fields))  # fmt: skip
    for row in rows:
        base = next((r for r in rows if r["name"] == BASELINE and r["batch"] == row["batch"]), None)
        if "error" not in row and base is not None and "error" not in base:
            row["speedup_vs_hf_dynamic"] = row["decode_tok_s"] / base["decode_tok_s"]
    return rows


def run_long(args, common: dict) -> dict:
    """The ``--long`` experiment: jaxkv static decode at the default capacity ("small") and at ``--long-capacity``."""
    small_capacity = bucket(bucket(args.long_prompt) + args.long_new_tokens)
    long = dict(prompt_tokens=args.long_prompt, new_tokens=args.long_new_tokens,
                small_capacity=small_capacity, large_capacity=args.long_capacity)  # fmt: skip
    if args.long_capacity <= small_capacity:
        print(f"[bench] warning: --long-capacity {args.long_capacity} is not above the default capacity "
              f"{small_capacity} for a {args.long_prompt}-token prompt", file=sys.stderr)  # fmt: skip
    for which, capacity in (("small", None), ("large", args.long_capacity)):
        spec = dict(
            kind="long", system="jaxkv", cache="static", model_kwargs={}, batch=1, prompt=None,
            prompt_tokens=args.long_prompt, new_tokens=args.long_new_tokens, max_length=capacity,
            label=f"long jaxkv-static capacity {capacity or small_capacity}", **common,
        )  # fmt: skip
        result = run_config(args, spec)
        result.update(batch=1, prompt_tokens=args.long_prompt, new_tokens=args.long_new_tokens)
        add_rates(result)
        long[which] = result
    if "error" not in long["small"] and "error" not in long["large"]:
        long["ratio"] = long["large"]["decode_ms_per_step"] / long["small"]["decode_ms_per_step"]
    return long


def run_quantized(args, common: dict) -> list[dict]:
    """The ``--quantized`` experiment: one row per ``QUANTIZED_FORMATS`` entry (median of ``--repeat``
    fresh workers by decode speed), with its decode and perplexity-window times over full precision's."""
    rows = []
    for name in ["full", *args.quantized_formats]:
        spec = dict(
            quantization=QUANTIZED_FORMATS[name],
            kind="quantized", system="jaxkv", model_kwargs={}, prompt_tokens=args.quantized_context,
            new_tokens=args.quantized_new_tokens, label=f"quantized K/V {name}", **common,
        )  # fmt: skip
        rows.append(repeated(args, spec, name=name, batch=1, prompt_tokens=args.quantized_context,
                             new_tokens=args.quantized_new_tokens))  # fmt: skip
    full = rows[0]
    for row in rows:
        if "error" not in row and "error" not in full:
            row["decode_vs_full"] = row["decode_ms_per_step"] / full["decode_ms_per_step"]
            row["window_vs_full"] = row["window_s"] / full["window_s"]
    return rows


def print_quantized(rows: list[dict], context: int) -> None:
    print(f"\n### Quantized K/V (jaxkv static, batch 1, {context}-token context of random ids)\n")
    print("| cache | K/V MiB | prefill s | decode ms/step | vs full | perplexity window s "
          f"({PERPLEXITY_CHUNK}-token chunks) | vs full |\n|---|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'][:60]} | | | | | |")
            continue
        print(f"| {r['name']} | {r['cache_bytes'] / 2**20:.2f} | {r['prefill_s']:.2f} | "
              f"{r['decode_ms_per_step']:.2f} | {fmt(r.get('decode_vs_full'), '.2f')}x | {r['window_s']:.2f} | "
              f"{fmt(r.get('window_vs_full'), '.2f')}x |")


def quantized_targets(rows: list[dict]) -> list[dict]:
    targets = []
    for row in rows[1:]:
        for what, key in (("decode", "decode_vs_full"), ("perplexity window", "window_vs_full")):
            value = row.get(key)
            targets.append(
                dict(
                    target=f"quantized {row['name']} {what} <= {TARGET_QUANTIZED_RATIO}x full precision",
                    value=value,
                    display="not measured" if value is None else f"{value:.2f}x",
                    passed=None if value is None else value <= TARGET_QUANTIZED_RATIO,
                )
            )
    return targets


def print_long(long: dict) -> None:
    print("\n### Cache capacity (jaxkv static, batch 1)\n")
    print(f"prompt {long['prompt_tokens']} random ids, {long['new_tokens']} new tokens")
    for which in ("small", "large"):
        r, cap = long[which], long[f"{which}_capacity"]
        value = f"failed: {r['error'][:80]}" if "error" in r else f"{r['decode_ms_per_step']:.2f} ms/step"
        print(f"- capacity {cap}: {value}")
    if long.get("ratio") is not None:
        print(f"- ratio {long['large_capacity']}/{long['small_capacity']}: {long['ratio']:.3f}")


def print_bound(bound: dict | None) -> None:
    print("\n### Memory-bandwidth bound (batch 1 decode)\n")
    if bound is None:
        print("- not available (bandwidth or model measurement failed)")
        return
    print(
        f"- bandwidth {bound['bandwidth_gbps']:.1f} GB/s (numpy copy {fmt(bound['numpy_copy_gbps'])}, "
        f"jax sum {bound['jax_sum_gbps']:.1f})\n"
        f"- bytes per step: parameters {bound['param_bytes'] / 2**20:.1f} MiB + live K/V "
        f"{bound['kv_bytes'] / 2**20:.2f} MiB (average context)\n"
        f"- upper bound {bound['tok_s_upper_bound_b1']:.1f} tok/s"
        + (
            f" ({bound['tok_s_upper_bound_b1_allocated_cache']:.1f} tok/s reading the whole static buffer)"
            if "tok_s_upper_bound_b1_allocated_cache" in bound
            else ""
        )
    )
    for key, value in bound.items():
        if key.startswith("fraction_of_bound_"):
            print(f"- {key.removeprefix('fraction_of_bound_')} b1 reaches {100 * value:.1f}% of the bound")


def print_report(title: str, rows: list[dict], long: dict | None, targets: list[dict], bound: dict | None,
                 agree: dict, table: str, device: str) -> None:  # fmt: skip
    """The markdown report on stdout (a warning on stderr when jaxkv did not run on the CPU)."""
    backends = sorted({r["backend"] for r in rows if r.get("backend")})
    if device == "cpu" and backends and backends != ["cpu"]:
        print(f"[bench] warning: jaxkv ran on {backends}, transformers on CPU; set JAX_PLATFORMS=cpu to compare like "
              "with like", file=sys.stderr)  # fmt: skip
    print(f"## Decode benchmark: {title}\n")
    print(table)
    if long is not None:
        print_long(long)
    print_targets(targets)
    print_bound(bound)
    print("\n### Bytes read per decode step (weights + every row's live K/V, average context)\n")
    print(bytes_table(rows))
    if agree:
        print("\nGreedy agreement with jaxkv-static (leading tokens of row 0): "
              + ", ".join(f"{k} {v}" for k, v in agree.items()))  # fmt: skip


def write_outputs(args, report: dict, title: str) -> None:
    """``OUT.json`` and, when matplotlib is installed, the chart ``OUT.png``."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out.with_suffix(".json"), args.out.with_suffix(".png")
    json_path.write_text(json.dumps(report, indent=2))
    try:
        plot(report["rows"], report["long"], png_path, title)
    except ImportError:
        print(f"\nwrote {json_path}; no chart: matplotlib is not installed (pip install 'jaxkv[bench]')")
    else:
        print(f"\nwrote {json_path} and {png_path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return run_as_worker(args.worker, run_spec)

    start = time.perf_counter()
    prompt = prompt_ids(args.model, args.prompt_tokens)
    common = dict(model=args.model, dtype=args.dtype, threads=args.threads, device=args.device)
    membw = measure_bandwidth(args.membw_mib, args.device, label="memory bandwidth", timeout=args.worker_timeout,
                              verbose=args.verbose)  # fmt: skip
    if args.device == "gpu" and "error" in membw:
        print(f"jaxkv bench decode: --device gpu, but JAX found no GPU ({membw['error']}); install a CUDA jax "
              '(pip install "jax[cuda12]") on a machine with an NVIDIA GPU', file=sys.stderr)  # fmt: skip
        return 2
    rows = run_configurations(args, prompt, common)
    for row in rows:
        if "error" not in row:
            row["bytes"] = decode_bytes(row, membw.get("gbps"))
    long = run_long(args, common) if args.long else None
    quantized = run_quantized(args, common) if args.quantized else None

    targets = check_targets(rows, long) + (quantized_targets(quantized) if quantized else [])
    bound = bandwidth_bound(rows, membw, len(prompt), args.new_tokens)
    agree = agreement(rows)
    table = markdown_table(rows)
    where = f"{cpu_cores()} cores" if args.device == "cpu" else "GPU"
    weights = "" if args.weights is None else f", jaxkv weights {args.weights}"
    title = f"{args.model} {args.dtype}{weights}: prompt {len(prompt)} tok, {args.new_tokens} new, greedy; {where}"
    print_report(title, rows, long, targets, bound, agree, table, args.device)
    if quantized:
        print_quantized(quantized, args.quantized_context)
    report = dict(
        settings=dict(
            model=args.model, dtype=args.dtype, device=args.device, batch=args.batch, new_tokens=args.new_tokens,
            prompt_tokens=len(prompt), systems=args.systems, prompt_ids=prompt, weights=args.weights,
            threads=args.threads,
        ),
        environment=environment(args.threads), rows=rows, long=long, quantized=quantized, targets=targets,
        memory_bandwidth=membw,
        bandwidth_bound=bound, greedy_agreement=agree, table_markdown=table,
        total_seconds=time.perf_counter() - start,
    )  # fmt: skip
    write_outputs(args, report, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
