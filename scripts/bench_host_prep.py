#!/usr/bin/env python
"""Does preparing step n+1 on the host while the device runs step n pay? (issue 58, the step plan)

    python scripts/bench_host_prep.py                           # a tiny Llama, 8 and 32 rows
    python scripts/bench_host_prep.py --model smollm2 --rows 8 32 --steps 6 --rounds 5

JAX dispatches a step asynchronously, so the host could schedule, plan, apply and pack step n+1
while the device computes step n; the next plan depends on step n's drawn tokens only where a
chunk draws (and on its stops). This prototype measures the best case, the decode-only steady
state: ``rows`` rows decoding greedily, end-of-sequence ignored, no row finishing, no drafts, no
forks. Three loops over one engine, interleaved in ``--rounds`` rounds of ``--steps`` steps:

* ``Engine.step``;
* sync: the pieces below one after the other (``Engine.step``'s order), to compare like with like;
* overlapped: dispatch step n; append a placeholder for each drawn token and advance the
  sequences; schedule, plan, apply and pack step n+1 (the block tables handed to a dispatched
  step are copies: the next plan writes them while it runs); wait for step n's outputs; put the
  drawn tokens in place (in the sequences and in step n+1's packed tokens); process the outputs
  (forks, usage, the outputs) as the engine does.

Prints the median milliseconds per step of each loop and the host stages of ``Engine.step``, and
whether the sync and overlapped loops drew the same tokens. The engine keeps the sync order: the
measured gain is the host's preparation only, and the engine's stops, drafts and forks would need
the placeholders undone (docs/serving.md, "The step plan and the persistent block tables").
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from jaxkv.serving import Engine
from jaxkv.serving.plan import plan_step

PLACEHOLDER = -1  # a drawn token not known yet
TINY = {"vocab_size": 61, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048}  # fmt: skip


def steady(engine: Engine, rows: int, prompt: int, seed: int = 0) -> None:
    """``rows`` requests of ``prompt`` random tokens, stepped until each has drawn a token."""
    rng = np.random.default_rng(seed)
    vocab = engine.model.config.vocab_size
    for _ in range(rows):
        engine.add_request(rng.integers(3, vocab - 3, prompt).tolist(), max_tokens=900, ignore_eos=True)
    while any(not seq.output for seqs in engine.sequences.values() for seq in seqs):
        engine.step()


def _prepare(engine: Engine):
    """Schedule, plan, apply and pack the next step; its inputs hold copies of the block tables."""
    chunks = engine.scheduler.schedule()
    plan = plan_step(engine.scheduler, chunks)
    engine.runner.apply(plan)
    inputs = engine.runner.prepare(plan.chunks)
    tables = {name: table.copy() for name, table in inputs.packed.block_tables.items()}
    return plan.chunks, inputs.replace(packed=inputs.packed.replace(block_tables=tables))


def _dispatch(engine: Engine, inputs):
    """Start the step on the device; its outputs, not waited for."""
    runner = engine.runner
    outputs, runner.cache = runner._executable(inputs)(runner.state, runner.cache, inputs)
    runner.num_steps += 1
    return outputs


def _append(engine: Engine, chunks, outputs, draws: list[bool], placeholders: bool):
    """Append each drawing chunk's token (in place of its placeholder); the tokens by row and each
    chunk's ``(new tokens, finish reason)``."""
    drawn, news = {}, []
    for slot, (chunk, draw) in enumerate(zip(chunks, draws, strict=True)):
        if not draw:
            news.append(([], None))
            continue
        seq, token = chunk.seq, int(outputs.tokens[slot, 0])
        if placeholders:
            seq.output.pop()
        reason = engine.outputs.append(seq, token, outputs.logprobs[slot, 0], outputs.top_tokens[slot, 0],
                                       outputs.top_logprobs[slot, 0])  # fmt: skip
        drawn[seq.row] = token
        news.append(([token], reason))
    return drawn, news


def _finish(engine: Engine, chunks, news) -> list:
    """What ``Engine.step`` does after ``computed``: forks, usage; the step's outputs."""
    engine._fork()
    engine._record_usage()
    return engine._take_final() + [engine._finish(chunk.seq, *new) for chunk, new in zip(chunks, news)]


def sync_steps(engine: Engine, steps: int, timings: list[float]) -> None:
    for _ in range(steps):
        start = time.perf_counter()
        chunks, inputs = _prepare(engine)
        outputs = jax.device_get(_dispatch(engine, inputs))
        draws = [chunk.draws_next for chunk in chunks]
        _, news = _append(engine, chunks, outputs, draws, placeholders=False)
        engine.scheduler.computed(list(chunks))
        _finish(engine, chunks, news)
        timings.append(1000 * (time.perf_counter() - start))


def overlapped_steps(engine: Engine, steps: int, timings: list[float]) -> None:
    """``steps`` overlapped steps, then the step prepared last run as a sync one."""
    chunks, inputs = _prepare(engine)
    for _ in range(steps):
        start = time.perf_counter()
        pending = _dispatch(engine, inputs)
        draws = [chunk.draws_next for chunk in chunks]
        for chunk, draw in zip(chunks, draws):
            if draw:
                chunk.seq.output.append(PLACEHOLDER)
        engine.scheduler.computed(list(chunks))
        next_chunks, next_inputs = _prepare(engine)
        drawn, news = _append(engine, chunks, jax.device_get(pending), draws, placeholders=True)
        slots = np.flatnonzero(next_inputs.tokens == PLACEHOLDER)
        next_inputs.tokens[slots] = [drawn[int(row)] for row in next_inputs.packed.token_rows[slots]]
        _finish(engine, chunks, news)
        chunks, inputs = next_chunks, next_inputs
        timings.append(1000 * (time.perf_counter() - start))
    outputs = jax.device_get(_dispatch(engine, inputs))
    draws = [chunk.draws_next for chunk in chunks]
    _, news = _append(engine, chunks, outputs, draws, placeholders=False)
    engine.scheduler.computed(list(chunks))
    _finish(engine, chunks, news)


def engine_steps(engine: Engine, steps: int, timings: list[float]) -> None:
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        timings.append(1000 * (time.perf_counter() - start))


def stage_times(engine: Engine, steps: int) -> dict[str, float]:
    """Median milliseconds of ``Engine.step``'s host stages over ``steps`` steps."""
    found: dict[str, list[float]] = {"schedule+plan": [], "apply": [], "prepare": [], "dispatch+wait": [],
                                     "outputs": []}  # fmt: skip
    runner = engine.runner
    run = runner.run

    def timed(name, fn):
        def wrapper(*args):
            start = time.perf_counter()
            result = fn(*args)
            found[name].append(1000 * (time.perf_counter() - start))
            return result

        return wrapper

    def run_timed(chunks):
        start = time.perf_counter()
        result = run(chunks)
        found["dispatch+wait"].append(1000 * (time.perf_counter() - start) - found["prepare"][-1])
        return result

    engine._schedule = timed("schedule+plan", engine._schedule)
    engine._apply = timed("apply", engine._apply)
    engine._process = timed("outputs", engine._process)
    runner.prepare = timed("prepare", runner.prepare)
    runner.run = run_timed
    engine_steps(engine, steps, [])
    del engine._schedule, engine._apply, engine._process, runner.prepare, runner.run
    return {name: statistics.median(values) for name, values in found.items()}


def same_tokens(make, rows: int, prompt: int, steps: int) -> bool:
    """Do the sync and the overlapped loops draw the same tokens from the same start?"""
    sync, overlapped = make(), make()
    for engine in (sync, overlapped):
        steady(engine, rows, prompt)
    sync_steps(sync, steps, [])
    overlapped_steps(overlapped, steps - 1, [])
    return [[seq.output for seq in seqs] for seqs in sync.sequences.values()] == [
        [seq.output for seq in seqs] for seqs in overlapped.sequences.values()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (a random tiny Llama) or load_pretrained's name")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if args.model == "tiny":
        from jaxkv.models.llama import Llama, LlamaConfig

        model = Llama(LlamaConfig(**TINY))
    else:
        from jaxkv.models.load import load_pretrained

        model, _ = load_pretrained(args.model)
    for rows in args.rows:

        def make(rows=rows) -> Engine:
            return Engine(model, kv_memory="256MiB", max_num_seqs=rows, max_num_batched_tokens=64, max_model_len=1024)

        same = same_tokens(make, rows, args.prompt, 6)
        engine = make()
        engine.warmup()
        steady(engine, rows, args.prompt)
        loops = {"Engine.step": engine_steps, "sync": sync_steps, "overlapped": overlapped_steps}
        timings = {name: [] for name in loops}
        for _ in range(args.rounds):
            for name, loop in loops.items():
                loop(engine, args.steps, timings[name])
        stages = stage_times(engine, 2 * args.steps)
        print(f"{args.model}, {rows} rows, {jax.devices()[0].device_kind}: same tokens {same}")
        for name, found in timings.items():
            print(f"  {name:12s} median {statistics.median(found):.2f} ms/step ({len(found)} steps)")
        print("  Engine.step stages (median ms): " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))


if __name__ == "__main__":
    main()
