#!/usr/bin/env python
"""Where the serving engine's step spends its time: host stages and XLA's ops, by category.

    python scripts/profile_step.py                          # SmolLM2, 1 / 8 / 32 rows, decode and decode+prefill
    python scripts/profile_step.py --rows 16 --steps 8 --out results/step-profile.json
    python scripts/profile_step.py --rows 3 --prompt 1000 --max-pages-per-request 80 --compaction-policy snapkv
    python scripts/profile_step.py --rows 4 --prompt 4000 --max-model-len 4096 --retrieval-budget 256

Each case runs ``Engine.step`` on SmolLM2-135M (float32, greedy, prompts of ``--prompt``
random tokens, end-of-sequence ignored) with ``rows`` running rows: ``decode``, every row
decoding; ``prefill``, ``rows - 1`` rows decoding and one row prefilling a long prompt, a
``--max-num-batched-tokens`` chunk per step. ``--steps`` steps are traced with JAX's profiler
(``jax.profiler.trace``; XLA's CPU runtime records one event per executed op, its "thunk").

Per step (medians over the traced steps, milliseconds):

* host stages, from the engine's trace annotations: ``engine.schedule`` (scheduler and the step
  plan: the block-table rows that changed), ``engine.apply`` (the plan's page moves and copies,
  its rows written into the runner's block tables), ``runner.prepare`` (packing the inputs), ``runner.dispatch`` (the call of the
  compiled step: argument handling and host-to-device transfer; it returns before the device
  is done), ``runner.wait`` (waiting for the device and copying the outputs back),
  ``engine.outputs`` (appending tokens, detokenizing, stops, metrics);
* device ops by category, from the thunk events, each op classified by the functions on its
  stack (the optimized HLO's stack frames): GEMMs (the projections and MLP), the LM head,
  attention's page gathers, attention's dot products, attention's mask and online softmax,
  K/V page writes, sampling and log-probabilities, norms/RoPE/embedding, and ``layout``
  (copies and broadcasts XLA inserted, no source). Op time is summed over XLA's threads,
  so a category's share is of the summed op time; ``device span`` runs from the first op's
  start to the last op's end. The slowest ops are listed with their HLO.

Outputs a markdown table per case and ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gzip
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from jaxkv.models.load import load_pretrained

from jaxkv.engine_args import add_engine_flags, engine_config, load_engine
from jaxkv.serving import Engine

HOST_STAGES = ("engine.schedule", "engine.apply", "runner.prepare", "runner.dispatch", "runner.wait", "engine.outputs")
# First match wins, innermost function first: (category, functions on the op's stack, needs a dot).
CATEGORY_RULES = (
    ("attention: retrieval (scores, top-k)", ("PagedKVView._chosen_columns",), False),
    ("attention: retrieved page gathers", ("PagedKVView._gathered",), False),
    ("attention: retrieved pages' dots, softmax", ("PagedKVView._retrieved",), False),
    ("page summaries", ("PagedLayer._summarized",), False),
    ("K/V page writes", ("PagedLayer.attend_packed_entry.<locals>.write", "PagedLayer._slots"), False),
    ("attention: the CPU kernel (pages read in place)", ("PagedKVView._cpu_blocks",), False),
    ("attention: page gathers", ("PagedKVView.gather", "PagedKVView.read_block"), False),
    ("attention: QK and PV dots", ("PagedKVView._read_blocks",), True),
    ("attention: mask, online softmax", ("PagedKVView._read_blocks", "PagedKVView.block_range"), False),
    ("LM head", ("Decoder.head", "output_logits", "at_logits_index"), False),
    ("GEMMs (QKV, O, MLP)", ("Decoder.matmul",), True),
    ("sampling, log-probs", ("sample_rows", "_row_keys", "serving_step.<locals>.top"), False),
    ("norms, RoPE, embedding, other", ("rms_norm", "apply_rope", "Decoder.matmul", "Llama.__call__"), False),
)
# The layer scan's slice of one layer's stacked weights (jax.lax.scan's dynamic_index_in_dim): a copy on XLA's CPU.
LAYER_SLICE, SLICE_OPCODE = "jit(dynamic_index_in_dim)", "layer-slice"
SLICE_CATEGORY = "layer scan: weight slice copies"
SAMPLING_LINES = "serving_step"  # the log-softmax and chosen log-prob sit in serving_step itself
CONTROL_OPCODES = {"while", "conditional", "call"}


# ----------------------------------------------------------------------------------------------
# the optimized HLO: op name -> category


def _table(text: str, heading: str) -> dict[int, str]:
    """One of the HLO text's numbered tables (``FileNames``, ``FunctionNames``, ...)."""
    match = re.search(rf"^{heading}\n((?:\d+ .*\n)+)", text, re.M)
    rows = match.group(1).splitlines() if match else []
    return {int(row.split(" ", 1)[0]): row.split(" ", 1)[1] for row in rows}


def _stacks(text: str) -> dict[int, list[str]]:
    """Stack frame id -> function names, innermost first."""
    functions = {key: value.strip('"') for key, value in _table(text, "FunctionNames").items()}
    locations = {key: int(re.search(r"function_name_id=(\d+)", value).group(1))
                 for key, value in _table(text, "FileLocations").items()}  # fmt: skip
    frames = {}
    for key, value in _table(text, "StackFrames").items():
        location = int(re.search(r"file_location_id=(\d+)", value).group(1))
        parent = int(re.search(r"parent_frame_id=(\d+)", value).group(1))
        frames[key] = (functions[locations[location]], parent)
    stacks = {}
    for key in frames:
        names, frame = [], key
        while frame in frames:  # the printed parent is one above the frame's number; 0: none
            name, parent = frames[frame]
            names.append(name)
            frame = parent - 1
        stacks[key] = names
    return stacks


def _category(stack: list[str], has_dot: bool) -> str:
    for category, functions, needs_dot in CATEGORY_RULES:
        if (has_dot or not needs_dot) and any(name in functions for name in stack):
            return category
    if stack and stack[0] == SAMPLING_LINES:
        return "sampling, log-probs"
    return "layout (copies, no source)" if not stack else "norms, RoPE, embedding, other"


INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = \S+ (\w[\w\-]*)\(")


def op_categories(text: str) -> tuple[dict[str, str], set[str]]:
    """Each HLO instruction's category (a fusion by its own stack, or its fused ops' when it
    has none; a dot anywhere in it makes it a dot); and the control-flow ops (whose bodies'
    ops report their own time)."""
    stacks = _stacks(text)
    computations: dict[str, list[tuple[str, str, int | None, str]]] = collections.defaultdict(list)
    current = None
    for line in text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
        if header and line.rstrip().endswith("{"):
            current = header.group(1)
            continue
        match = INSTRUCTION.match(line)
        if match and current:
            frame = re.search(r"stack_frame_id=(\d+)", line)
            called = re.search(r"calls=%?([\w.\-]+)", line)
            opcode = SLICE_OPCODE if LAYER_SLICE in line else match.group(2)
            computations[current].append(
                (match.group(1), opcode, int(frame.group(1)) if frame else None, called.group(1) if called else "")
            )
    categories, control = {}, set()
    for ops in computations.values():
        for name, opcode, frame, called in ops:
            inner = computations.get(called, [])
            has_dot = opcode in ("dot", "convolution") or any(op[1] in ("dot", "convolution") for op in inner)
            if frame is None:
                frame = next((op[2] for op in inner if op[2] is not None), None)
            sliced = opcode == SLICE_OPCODE or any(op[1] == SLICE_OPCODE for op in inner)
            categories[name] = SLICE_CATEGORY if sliced else _category(stacks.get(frame, []), has_dot)
            if opcode in CONTROL_OPCODES:
                control.add(name)
    return categories, control


# ----------------------------------------------------------------------------------------------
# the trace


def _events(trace_dir: Path) -> list[dict]:
    path = max(trace_dir.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    data = json.load(gzip.open(path))
    return [event for event in data["traceEvents"] if event.get("ph") == "X"]


def step_breakdown(events: list[dict], categories: dict[str, str], control: set[str]) -> list[dict]:
    """Per traced step (one ``engine.schedule`` to the next): host stage, op category and op
    (``"op NAME"``) milliseconds, and the span from the first op's start to the last op's end."""
    starts = sorted(event["ts"] for event in events if event["name"] == "engine.schedule")
    bounds = list(zip(starts, [*starts[1:], float("inf")]))
    steps = [collections.Counter() for _ in bounds]
    spans: dict[int, tuple[float, float]] = {}
    for event in events:
        name = event["name"]
        index = next((i for i, (start, end) in enumerate(bounds) if start <= event["ts"] < end), None)
        if index is None:
            continue
        if name in HOST_STAGES:
            steps[index][name] += event["dur"] / 1000
        elif name in categories and name not in control:
            steps[index][categories[name]] += event["dur"] / 1000
            steps[index]["ops total"] += event["dur"] / 1000
            steps[index][f"op {name}"] += event["dur"] / 1000
            first, last = spans.get(index, (event["ts"], event["ts"]))
            spans[index] = (min(first, event["ts"]), max(last, event["ts"] + event["dur"]))
    for index, (first, last) in spans.items():
        steps[index]["device span"] = (last - first) / 1000
    return [dict(step) for step in steps]


# ----------------------------------------------------------------------------------------------
# the cases


def _start_case(engine: Engine, args, rows: int, prefill: bool) -> None:
    """Bring ``engine`` (emptied first) to ``rows`` running rows: all decoding, or one of them
    prefilling a long prompt."""
    for request_id in list(engine.sequences):
        engine.pop(request_id)
    engine.step()  # report the aborts
    rng = np.random.default_rng(rows)
    vocab = engine.model.config.vocab_size
    for _ in range(rows - 1 if prefill else rows):
        engine.add_request(rng.integers(100, vocab - 100, args.prompt).tolist(), max_tokens=256, ignore_eos=True)
    while any(not seq.output for seqs in engine.sequences.values() for seq in seqs):
        engine.step()
    if prefill:
        long_prompt = rng.integers(100, vocab - 100, engine.config.max_num_batched_tokens * (args.steps + 2)).tolist()
        engine.add_request(long_prompt, max_tokens=1, ignore_eos=True)
        engine.step()  # the first chunk: from here on every step has a full chunk


def profile_case(engine: Engine, args, rows: int, prefill: bool) -> dict:
    _start_case(engine, args, rows, prefill)
    with tempfile.TemporaryDirectory() as trace_dir:
        walls = []
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                walls.append(1000 * (time.perf_counter() - start))
        events = _events(Path(trace_dir))
    runner = engine.runner
    config = engine.config
    shape = (config.max_num_seqs, config.max_num_batched_tokens) if prefill else runner.prepare_shape(rows, 0)
    shape = (*shape, 1)
    executable = runner.executables[shape]
    hlo = executable.as_text()
    steps = step_breakdown(events, *op_categories(hlo))
    keys = sorted({key for step in steps for key in step})
    medians = {key: statistics.median(step.get(key, 0.0) for step in steps) for key in keys}
    ops = {key[3:]: medians.pop(key) for key in keys if key.startswith("op ")}
    top = sorted(ops.items(), key=lambda item: -item[1])[: args.top]
    return {
        "rows": rows, "prefill": prefill, "decode_slots": shape[0], "step_ms": statistics.median(walls),
        "walls_ms": walls, **medians,
        "top_ops": [{"op": name, "ms": ms, "hlo": _describe(hlo, name)} for name, ms in top],
    }  # fmt: skip


def _describe(text: str, name: str) -> str:
    """An op's HLO line, shortened: its shape, opcode and source op name."""
    match = re.search(rf"^\s+(?:ROOT )?%?{re.escape(name)} = (.*)$", text, re.M)
    if not match:
        return ""
    line = match.group(1)
    op_name = re.search(r'op_name="([^"]*)"', line)
    return f"{line.split(', ')[0][:120]} [{op_name.group(1)[-90:] if op_name else ''}]"


def markdown(results: list[dict]) -> str:
    cases = [f"{r['rows']} rows{' + prefill' if r['prefill'] else ''} ({r['decode_slots']} slots)" for r in results]
    not_ops = {"rows", "prefill", "decode_slots", "step_ms", "walls_ms", "ops total", "device span", "top_ops"}
    ops = sorted({key for r in results for key in r} - not_ops - set(HOST_STAGES))
    lines = ["| ms per step | " + " | ".join(cases) + " |", "|---|" + "---:|" * len(cases)]

    def row(label: str, key: str, share: bool = False) -> None:
        cells = []
        for r in results:
            value = r.get(key, 0.0)
            cells.append(f"{value:.1f} ({100 * value / r['ops total']:.0f}%)" if share else f"{value:.1f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("step (wall)", "step_ms")
    for stage in HOST_STAGES:
        row(f"host: {stage}", stage)
    row("device: first op to last op", "device span")
    row("device: ops summed over threads", "ops total")
    for category in ops:
        row(f"op: {category}", category, share=True)
    for r, case in zip(results, cases):
        lines += [
            "",
            f"Top ops, {case} (ms per step):",
            *(f"- {op['ms']:.1f} {op['op']}: {op['hlo']}" for op in r["top_ops"]),
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--top", type=int, default=12, help="list this many of the slowest ops per case")
    parser.add_argument(
        "--unrolled", action="store_true", help="the model with its layers unrolled (scan_layers=False)"
    )
    parser.add_argument("--out", type=Path)
    add_engine_flags(parser)  # a page budget, retrieval, ... (docs/serving.md); --max-num-seqs defaults to 32 here
    parser.set_defaults(max_num_seqs=32)
    args = parser.parse_args()
    load = functools.partial(load_pretrained, **({"scan_layers": False} if args.unrolled else {}))
    engine, _ = load_engine("smollm2", engine_config(args), load=load)
    engine.warmup()
    results = [profile_case(engine, args, rows, prefill) for rows in args.rows for prefill in (False, True)]
    print(markdown(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "cases": results}, indent=1))


if __name__ == "__main__":
    main()
