"""Serving benchmark: the jaxkv engine (paged K/V, continuous batching, prefix caching) against
jaxkv's static-batch ``generate`` and transformers' continuous batching, on one seeded workload.

    jaxkv bench serving                                              # smollm2 float32, both workloads
    jaxkv bench serving --quick --out results/serving-smoke.json
    jaxkv bench serving --systems engine vllm vllm-matched --rate inf --repeat 3   # against vLLM

The workloads, the systems, the metrics and how they are measured: docs/benchmarks.md, "Serving";
the targets: docs/benchmark-targets.yaml. This module is the command line: its flags and ``main``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from jaxkv.bench.common import DEVICES, TINY, cpu_cores, environment
from jaxkv.bench.serving.metrics import bandwidth_bounds
from jaxkv.bench.serving.orchestration import measure_gpu_bandwidth, prepare_vllm, run_all
from jaxkv.bench.serving.report import json_settings, markdown_table, print_bounds, print_report, write_outputs
from jaxkv.bench.serving.systems import (
    COMPACT_PREFIX, ENGINE_SYSTEMS, ON_GPU, SYSTEMS, base_system, default_systems, system_name,
)  # fmt: skip
from jaxkv.bench.serving.targets import check_targets
from jaxkv.bench.serving.workloads import WORKLOADS, build_workloads, workload_summary
from jaxkv.bench.vllm_env import VENV
from jaxkv.engine_args import add_engine_flags, engine_config, section_flags

# --quick: a smoke run's defaults (flags given explicitly still win).
QUICK = dict(
    requests=8, min_prompt=8, max_prompt=64, min_output=8, max_output=24, system_prompts=2, system_prompt_tokens=32,
    static_batch=4,
)  # fmt: skip
POSITIVE = ("requests", "min_prompt", "min_output", "system_prompts", "static_batch", "repeat", "turns")
# The engine flags' defaults here where they differ from EngineConfig's.
ENGINE_DEFAULTS = dict(max_num_seqs=32)
# Old flags in MiB, still read (with a warning): the engine flags take sizes ('1GiB').
MIB_FLAGS = {"kv_memory_mib": "kv_memory", "host_kv_memory_mib": "host_kv_memory"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, checked (``--quick`` sets smoke-run defaults; a worker's is not checked)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    for add in (_run_flags, _workload_flags, _engine_flags, _output_flags):
        add(parser)
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    if args.systems is None:
        args.systems = default_systems(args.device)
    if args.worker is None:
        check_args(parser, args)
        _engine_settings(args)
    return args


def _engine_settings(args: argparse.Namespace) -> None:
    """``args.engine``: the engine flags as an ``EngineConfig`` (every engine system's base, which
    ``systems.system_engine`` varies); ``args.speculation``: the ``--speculative-*`` flags, which
    the speculating systems take with their own method."""
    for old, new in MIB_FLAGS.items():
        if getattr(args, old) is not None:
            print(f"jaxkv: warning: --{old.replace('_', '-')} is deprecated; use --{new.replace('_', '-')} "
                  f"{getattr(args, old)}MiB", file=sys.stderr)  # fmt: skip
            setattr(args, new, f"{getattr(args, old)}MiB")
    args.engine = engine_config(args, without=("speculative",))
    args.speculation = section_flags(args, "speculative")


def _run_flags(parser: argparse.ArgumentParser) -> None:
    """What runs, where and how often."""
    parser.add_argument("--model", default="smollm2", help=f"default model name, .gguf, checkpoint or {TINY}")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="every system")
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument(
        "--systems", nargs="+", type=system_name, metavar="SYSTEM",
        help=f"{', '.join(SYSTEMS)} or {COMPACT_PREFIX}<pages> (the engine, at most <pages> pages per request);\n"
        "default: all but vLLM's (the first vLLM run installs it, ~5 min) and those run only when named;\n"
        "with --device gpu, jaxkv's",
    )  # fmt: skip
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="where the jaxkv systems run")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each system, each in a fresh worker: rows "
                        "report medians (and output tok/s's min-max)")  # fmt: skip
    parser.add_argument("--vllm-venv", type=Path, default=VENV, help="vLLM's venv (made on first use)")
    parser.add_argument("--vllm-warm-up-requests", type=int, default=0,
                        help="requests vLLM serves before its timer (default none, as vllm bench throughput: its "
                        "engine start-up warms it up)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=cpu_cores(), help="torch threads (default: usable cores)")
    parser.add_argument(
        "--competing-cpu", type=int,
        help="run a busy loop pinned to this CPU beside every worker (a competing process); "
        "pin the systems themselves with taskset: taskset -c 0 jaxkv bench serving ...",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"smoke-run defaults: {QUICK}")
    parser.add_argument("--worker-timeout", type=float, default=None, help="seconds per system and workload")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)


def _workload_flags(parser: argparse.ArgumentParser) -> None:
    """The requests: how many, their lengths, their arrivals."""
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second (inf: all at once)")
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--system-prompts", type=int, default=8, help="shared-prefix: distinct system prompts")
    parser.add_argument("--system-prompt-tokens", type=int, default=400, help="shared-prefix: their length")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation (--requests of them)")
    parser.add_argument("--turn-tokens", type=int, default=64, help="multi-turn: a user part's most tokens")
    parser.add_argument("--static-batch", type=int, default=8, help="static batching: requests per batch")


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's settings, generated from ``EngineConfig`` (its pool and limits are also
    transformers' and vLLM-matched's; the speculating systems take the ``--speculative-*`` flags
    with their own method, the tier systems a host tier of 4GiB unless ``--host-kv-memory`` says)."""
    add_engine_flags(parser, skip=("seed", "speculative_method"))  # --seed: the workload's
    parser.set_defaults(**ENGINE_DEFAULTS)
    for old in MIB_FLAGS:
        parser.add_argument(f"--{old.replace('_', '-')}", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-concurrency", type=int, nargs="+",
                        help="run the engine systems at each of these caps on requests in flight (e.g. 1 4 16; "
                        "--rate inf holds the cap all run); a row per cap")  # fmt: skip


def _output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("results/serving.json"), help="JSON; the PNG goes next to it")
    parser.add_argument("--verbose", action="store_true", help="show the workers' output")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, by name, what cannot run: sizes out of range, systems off the GPU, an unknown CPU."""
    if any(getattr(args, name) < 1 for name in POSITIVE):
        parser.error(f"{', '.join('--' + name.replace('_', '-') for name in POSITIVE)} must be positive")
    if args.workload == "multi-turn" and args.turn_tokens < args.min_prompt:
        parser.error(f"--turn-tokens ({args.turn_tokens}) must be at least --min-prompt ({args.min_prompt})")
    if args.min_prompt > args.max_prompt or args.min_output > args.max_output:
        parser.error("--min-prompt/--min-output must not exceed --max-prompt/--max-output")
    if not args.rate > 0:
        parser.error("--rate must be positive (inf: every request arrives at the start)")
    off_gpu = [s for s in args.systems if base_system(s) not in ON_GPU]
    if args.device == "gpu" and off_gpu:
        parser.error(
            f"--device gpu runs jaxkv's systems ({', '.join(ON_GPU)}), not {', '.join(off_gpu)}: "
            "vLLM's build here is its CPU build, transformers' continuous batching is measured on the CPU"
        )
    if args.competing_cpu is not None and not 0 <= args.competing_cpu < (os.cpu_count() or 1):
        parser.error(f"--competing-cpu must name a CPU of this machine (0 to {(os.cpu_count() or 1) - 1}), "
                     f"got {args.competing_cpu}")  # fmt: skip
    if args.out.suffix != ".json":
        parser.error(f"--out names the JSON file (the chart takes its name with .png), got {args.out}")
    check_speculation_args(parser, args)
    check_engine_imports(parser, args)


def check_speculation_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--max-concurrency`` caps the engine systems only, each cap positive;
    ``--speculative-num-tokens`` in 1 to 15 (the engine's ``MAX_NUM_TOKENS``)."""
    from jaxkv.serving.speculation import MAX_NUM_TOKENS

    uncapped = [s for s in args.systems if base_system(s) not in ENGINE_SYSTEMS]
    if args.max_concurrency and uncapped:
        parser.error(f"--max-concurrency caps the engine systems' requests in flight; {', '.join(uncapped)} "
                     "have no such cap: run them without it")  # fmt: skip
    if args.max_concurrency and min(args.max_concurrency) < 1:
        parser.error(f"--max-concurrency must be positive, got {args.max_concurrency}")
    tokens = args.speculative_num_tokens
    if tokens is not None and not 1 <= tokens <= MAX_NUM_TOKENS:
        parser.error(f"--speculative-num-tokens must be in 1..{MAX_NUM_TOKENS}, got {tokens}")


def check_engine_imports(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The engine systems need ``jaxkv.serving.Engine`` to import."""
    engines = [s for s in args.systems if base_system(s) in ENGINE_SYSTEMS]
    problem = engines and engine_import_error()
    if problem:
        parser.error(f"{', '.join(engines)} need jaxkv.serving.Engine, which does not import here ({problem}); "
                     "run --systems static hf meanwhile")  # fmt: skip


def engine_import_error() -> str | None:
    """Why ``from jaxkv.serving import Engine`` fails, or None when it works."""
    try:
        from jaxkv.serving import Engine  # noqa: F401
    except ImportError as error:
        return str(error)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``jaxkv bench serving``: every system on every workload, the report on stdout, ``--out`` and its chart."""
    args = parse_args(argv)
    if args.worker is not None:
        from jaxkv.bench.serving.workers import worker_main

        return worker_main(args.worker)
    start = time.perf_counter()
    vllm, skipped = prepare_vllm(args)
    args.systems = [s for s in args.systems if s not in skipped]
    if not args.systems:
        print("[bench] no system left to run", file=sys.stderr)
        return 1
    membw = measure_gpu_bandwidth(args) if args.device == "gpu" else None
    if membw is not None and "error" in membw:
        print(f"jaxkv bench serving: --device gpu, but JAX found no GPU ({membw['error']}); install a CUDA jax "
              "(pip install 'jax[cuda12]') on a machine with one", file=sys.stderr)  # fmt: skip
        return 2
    workloads = build_workloads(args)
    rows = run_all(args, workloads, vllm)
    report = _report(args, workloads, rows, membw) | dict(
        skipped=skipped, checkpoint=None if vllm is None else str(vllm.checkpoint),
        total_seconds=time.perf_counter() - start,
    )  # fmt: skip
    write_outputs(args.out, report, list(workloads), _title(args))
    return 0


def _title(args: argparse.Namespace) -> str:
    rate = "all at once" if math.isinf(args.rate) else f"{args.rate:g} req/s"
    where = " on the GPU" if args.device == "gpu" else ""
    return f"{args.model} {args.dtype}{where}, {args.requests} requests, Poisson {rate}, seed {args.seed}"


def _report(args: argparse.Namespace, workloads: dict, rows: list[dict], membw: dict | None) -> dict:
    """The tables, targets and bounds printed, and the JSON report's measured part."""
    bounds = {} if membw is None else bandwidth_bounds(rows, workloads, membw, args.engine.max_num_seqs)
    targets = check_targets(rows)
    table = markdown_table(rows)
    summaries = {kind: workload_summary(requests) for kind, requests in workloads.items()}
    print_report(_title(args), table, targets, summaries, rows)
    if membw is not None:
        print_bounds(bounds)
    return dict(
        settings=json_settings(args), environment=environment(args.threads), workloads=summaries, rows=rows,
        targets=targets, table_markdown=table, memory_bandwidth=membw, bandwidth_bounds=bounds,
    )  # fmt: skip
