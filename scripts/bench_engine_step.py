"""The engine's decode-only step against ``generate``'s decode step at the same rows.

    python scripts/bench_engine_step.py --rows 16 --repeats 3

Both run SmolLM2-135M (float32, greedy) on prompts of 64 random tokens. ``generate``'s step
is its decode loop's seconds over its steps (``max_new_tokens`` 65 minus 1 prefill token);
the engine's is the median of ``Engine.step`` calls once every row decodes (its prefills
done, warmed up). Prints one JSON line per repeat and the medians.

Against an older commit: ``git worktree add /tmp/base REV``, link ``/tmp/base/jaxkv/models`` to
``/tmp/base/models``, and run this file with ``/tmp/base`` first on ``sys.path`` and the editable
install's finder removed from ``sys.meta_path`` (before 7fd3080 the engine's dict was ``samples``).
Interleave the two and keep the machine quiet: under load both steps double.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from jaxkv.models.load import load_pretrained

from jaxkv.decoding.generate import generate
from jaxkv.serving.engine import Engine

PROMPT_TOKENS, NEW_TOKENS = 64, 65


def _prompts(rows: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(100, vocab - 100, size=(rows, PROMPT_TOKENS)).tolist()


def generate_step_ms(model, prompts) -> float:
    generate(model, prompts, max_new_tokens=NEW_TOKENS)  # compile
    run = generate(model, prompts, max_new_tokens=NEW_TOKENS)
    return 1000 * run.decode_seconds / (NEW_TOKENS - 1)


def engine_step_ms(model, prompts) -> float:
    engine = Engine(model, kv_memory="256MiB", max_num_seqs=len(prompts), max_num_batched_tokens=256)
    engine.warmup()
    for prompt in prompts:
        engine.add_request(prompt, max_tokens=NEW_TOKENS, ignore_eos=True)
    while any(len(s.output) == 0 for seqs in engine.sequences.values() for s in seqs):
        engine.step()
    seconds = []
    for _ in range(NEW_TOKENS - 2):
        start = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - start)
    return 1000 * statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, _ = load_pretrained("smollm2")
    prompts = _prompts(args.rows, model.config.vocab_size)
    runs = []
    for _ in range(args.repeats):
        run = {"generate_ms": generate_step_ms(model, prompts), "engine_ms": engine_step_ms(model, prompts)}
        print(json.dumps(run), flush=True)
        runs.append(run)
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    medians["engine_over_generate"] = medians["engine_ms"] / medians["generate_ms"]
    print(json.dumps({"rows": args.rows, "median": medians}))


if __name__ == "__main__":
    main()
