"""The serving benchmark's metrics: a run's throughput and latencies from its per-request records,
a row's medians over repeated runs, greedy agreement with the engine, and the decode's
memory-bandwidth bound (``--device gpu``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from jaxkv.bench.common import median_run
from jaxkv.bench.serving.systems import ON_GPU
from jaxkv.bench.vllm_worker import Record, ServingRequest

# Statistics every system reports (None where it does not apply or is not measured): a row's ``stats`` (the
# jaxkv engine's: ``EngineStats.as_dict()``, beside the worker's own).
STAT_KEYS = (
    "peak_kv_bytes", "wasted_slot_fraction", "prefix_hit_rate", "num_compiled", "xla_compiles_warmup",
    "xla_compiles_run", "preemptions", "peak_running", "mean_running", "compactions", "kv_bytes_per_request",
)  # fmt: skip
# Metrics a row reports as the median over its runs (output tok/s also with its min and max).
REPEATED_METRICS = (
    "output_tok_s", "requests_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "cpu_ms_per_token",
    "first_ttft_p50_s", "first_ttft_p99_s", "returning_ttft_p50_s", "returning_ttft_p99_s", "startup_s",
    "end_to_end_tok_s", "cpu_ms_per_token_with_startup",
)  # fmt: skip


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def turn_latencies(records: Sequence[Record], turns: Sequence[int]) -> dict:
    """Multi-turn: TTFT p50 and p99 of first turns and of returning turns (``turns[i]``: request
    ``i``'s turn); nothing for a workload without returning turns."""
    if not any(turns):
        return {}
    ttft = {returning: [r.first_token - r.arrival for r, t in zip(records, turns) if bool(t) is returning]
            for returning in (False, True)}  # fmt: skip
    return dict(
        first_ttft_p50_s=percentile(ttft[False], 50), first_ttft_p99_s=percentile(ttft[False], 99),
        returning_ttft_p50_s=percentile(ttft[True], 50), returning_ttft_p99_s=percentile(ttft[True], 99),
    )  # fmt: skip


def summarize(records: Sequence[Record]) -> dict:
    """Throughput over the makespan (start to last finish) and latency percentiles."""
    makespan = max(r.finish for r in records)
    output_tokens = sum(r.output_tokens for r in records)
    ttft = [r.first_token - r.arrival for r in records]
    tpot = [(r.finish - r.first_token) / (r.output_tokens - 1) for r in records if r.output_tokens > 1]
    return dict(
        makespan_s=makespan, output_tokens=output_tokens, output_tok_s=output_tokens / makespan,
        requests_s=len(records) / makespan, ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_ms=_ms(percentile(tpot, 50)), tpot_p99_ms=_ms(percentile(tpot, 99)),
    )  # fmt: skip


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds



def run_metrics(result: dict, turns: Sequence[int]) -> dict:
    """A worker's run: its metrics (``summarize``, ``turn_latencies``; ``turns[i]``: request ``i``'s
    turn), its CPU milliseconds per output token, and the same two with its start-up inside the
    clock (``vllm_worker.startup``: a harness that times a fresh process from its start):
    ``end_to_end_tok_s`` = output tokens / (start-up + makespan), ``cpu_ms_per_token_with_startup``."""
    records = [Record(**r) for r in result["records"]]
    metrics = summarize(records) | turn_latencies(records, turns)
    tokens = metrics["output_tokens"]
    return metrics | dict(
        cpu_ms_per_token=1000 * result["cpu_s"] / tokens, startup_s=result["startup_s"],
        end_to_end_tok_s=tokens / (result["startup_s"] + metrics["makespan_s"]),
        cpu_ms_per_token_with_startup=1000 * (result["startup_cpu_s"] + result["cpu_s"]) / tokens,
    )  # fmt: skip


def kv_bytes_per_request(requests: Sequence[ServingRequest], stats: dict, max_pages: int | None) -> float:
    """The K/V bytes a request holds at its longest (its prompt and all but its last output token),
    over the requests: whole pages of ``stats['page_bytes']``, at most ``max_pages`` (None: no budget)."""
    pages = np.array([math.ceil((len(r.prompt) + r.max_tokens - 1) / stats["page_size"]) for r in requests])
    return float(np.mean(np.minimum(pages, max_pages or pages.max())) * stats["page_bytes"])


def aggregate(runs: list[dict]) -> dict:
    """Medians of ``REPEATED_METRICS`` over the successful runs, output tok/s's min and max, and
    how many runs succeeded and failed (no successful run: the last error)."""
    ok = [r for r in runs if "error" not in r]
    counts = dict(repeats=len(ok), failed_runs=len(runs) - len(ok))
    if not ok:
        return counts | dict(error=runs[-1]["error"])
    medians = {key: _median([r.get(key) for r in ok]) for key in REPEATED_METRICS}
    tok_s = [r["output_tok_s"] for r in ok]
    return counts | medians | dict(output_tok_s_min_max=[min(tok_s), max(tok_s)])


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else None


def make_row(kind: str, system: str, runs: list[dict], concurrency: int | None = None) -> dict:
    """A table row: the median run (by output tok/s: its records, stats and token ids) with the
    medians over all runs (``aggregate``) and every run under ``runs``."""
    middle = median_run(runs, "output_tok_s") or {}
    return dict(workload=kind, system=system, max_concurrency=concurrency) | middle | aggregate(runs) | dict(runs=runs)


def find_row(rows: list[dict], kind: str, system: str, concurrency: int | None = None) -> dict | None:
    """The successful row of ``system`` on ``kind`` at the ``concurrency`` cap (None: uncapped), or None."""
    key = (kind, system, concurrency)
    return next((r for r in rows if (r["workload"], r["system"], r.get("max_concurrency")) == key
                 and "error" not in r), None)  # fmt: skip


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> int:
    """How many requests generated the same token ids in both runs."""
    return sum(a == b for a, b in zip(reference, other, strict=True))


def add_agreement(rows: list[dict]) -> None:
    """Each row with token ids gets ``agreement``: its runs' fewest requests whose greedy tokens
    equal the reference engine's (``engine``, else ``engine-no-prefix``; its median run; at the
    same concurrency), of all."""
    for kind, concurrency in {(r["workload"], r.get("max_concurrency")) for r in rows}:
        reference = find_row(rows, kind, "engine", concurrency) or find_row(rows, kind, "engine-no-prefix", concurrency)
        if reference is None:
            continue
        for row in rows:
            runs = [r for r in row.get("runs", []) if "token_ids" in r]
            same_run = (row["workload"], row.get("max_concurrency")) == (kind, concurrency)
            if same_run and row is not reference and runs:
                equal = min(greedy_agreement(reference["token_ids"], r["token_ids"]) for r in runs)
                row["agreement"] = dict(equal=equal, total=len(reference["token_ids"]), reference=reference["system"])


def decode_bandwidth_bound(requests: list[ServingRequest], max_num_seqs: int, sizes: dict, gbps: float) -> dict:
    """Output tok/s the memory bandwidth ``gbps`` allows ``requests``' decode: steps of
    ``max_num_seqs`` rows (fewer when fewer requests), each reading the weights once
    (``sizes['param_bytes']``), and each decoded token reading its row's live K/V once
    (``sizes['kv_bytes_per_token']`` per cached token: the prompt and the tokens before it);
    prefill and compute are free. An upper bound for a system that keeps both in that memory."""
    prompts = np.array([len(r.prompt) for r in requests], np.float64)
    decoded = np.array([r.max_tokens - 1 for r in requests], np.float64)  # the first token is prefill's
    steps = math.ceil(decoded.sum() / min(max_num_seqs, len(requests)))
    kv_tokens = float(np.sum(decoded * prompts + decoded * (decoded + 1) / 2))
    total_bytes = steps * sizes["param_bytes"] + kv_tokens * sizes["kv_bytes_per_token"]
    output_tokens = sum(r.max_tokens for r in requests)
    return dict(bandwidth_gbps=gbps, decode_steps=steps, weight_bytes=steps * sizes["param_bytes"],
                kv_bytes=kv_tokens * sizes["kv_bytes_per_token"],
                output_tok_s=output_tokens * gbps * 1e9 / total_bytes)  # fmt: skip


def bandwidth_bounds(rows: list[dict], workloads: dict, membw: dict, max_num_seqs: int) -> dict[str, dict]:
    """Per workload, ``decode_bandwidth_bound`` and each jaxkv row's output tok/s as a fraction of it."""
    bounds = {}
    for kind, requests in workloads.items():
        measured = [r for r in rows if r["workload"] == kind and "error" not in r and r["system"] in ON_GPU]
        if not measured:
            continue
        bound = decode_bandwidth_bound(requests, max_num_seqs, measured[0]["runs"][0]["sizes"], membw["gbps"])
        bound["fraction"] = {r["system"]: r["output_tok_s"] / bound["output_tok_s"] for r in measured}
        bounds[kind] = bound
    return bounds

