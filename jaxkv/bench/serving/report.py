"""The serving benchmark's report: the markdown tables (every row; multi-turn, speculation and
compressed pages beside it), the targets and bounds on stdout, the JSON and the chart."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np

from jaxkv.bench.common import fmt, print_targets
from jaxkv.bench.serving.metrics import find_row
from jaxkv.bench.serving.systems import (
    ENGINE_SYSTEMS, SPECULATIVE_SYSTEMS, base_system, compaction_pages, system_color, system_title, workload_label,
)  # fmt: skip

TABLE_HEADER = (
    "workload", "system", "output tok/s", "req/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms",
    "CPU ms / out tok", "greedy = engine", "peak K/V MiB", "wasted K/V %", "prefix hits %", "compiles",
)  # fmt: skip
TURN_HEADER = ("system", "output tok/s", "TTFT p50 / p99 s, first turns", "TTFT p50 / p99 s, returning turns",
               "prefix hits %")  # fmt: skip
SPECULATION_HEADER = ("workload", "system", "output tok/s", "x engine", "TPOT p50 ms", "proposed", "accepted",
                      "acceptance %", "mean accepted length")  # fmt: skip
STARTUP_HEADER = ("workload", "system", "start-up s", "output tok/s", "end-to-end tok/s", "CPU ms / out tok",
                  "CPU ms / out tok with start-up")  # fmt: skip
COMPACTION_HEADER = ("workload", "system", "output tok/s", "x engine", "rows a step (mean / most)", "TTFT p50 s",
                     "TPOT p50 ms", "K/V MiB / request", "compactions", "preemptions")  # fmt: skip


def _markdown(header: tuple[str, ...], rows: list[list[str]], text_columns: int) -> str:
    """A markdown table: ``text_columns`` left-aligned columns, the others right-aligned."""
    rule = "|" + "|".join(["---"] * text_columns + ["---:"] * (len(header) - text_columns)) + "|"
    return "\n".join([_line(header), rule, *map(_line, rows)])


def _line(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def workload_cell(row: dict) -> str:
    """The row's workload, and its concurrency cap if it had one."""
    return workload_label(row["workload"], row.get("max_concurrency"))


def _times_engine(row: dict, rows: list[dict]) -> str:
    """The row's output tok/s as a multiple of ``engine``'s at the same workload and concurrency."""
    plain = find_row(rows, row["workload"], "engine", row.get("max_concurrency"))
    return "-" if plain is None else f"{row['output_tok_s'] / plain['output_tok_s']:.2f}"


def table_cells(row: dict) -> list[str]:
    """A row's cells; with several runs, output tok/s is the median (min-max), the others medians."""
    if "error" in row:
        return [workload_cell(row), system_title(row["system"]), f"failed: {row['error'][:60]}"] + ["-"] * 11
    stats, agreement = row["stats"], row.get("agreement")
    tok_s = fmt(row["output_tok_s"], ".1f")
    if row["repeats"] > 1:
        tok_s += " ({:.1f}-{:.1f})".format(*row["output_tok_s_min_max"])
    return [
        workload_cell(row), system_title(row["system"]), tok_s, fmt(row["requests_s"], ".2f"),
        fmt(row["ttft_p50_s"], ".2f"), fmt(row["ttft_p99_s"], ".2f"), fmt(row["tpot_p50_ms"], ".1f"),
        fmt(row["tpot_p99_ms"], ".1f"), fmt(row["cpu_ms_per_token"], ".1f"),
        "-" if agreement is None else f"{agreement['equal']}/{agreement['total']}",
        fmt(stats["peak_kv_bytes"], ".1f", 2**-20), fmt(stats["wasted_slot_fraction"], ".1f", 100),
        fmt(stats["prefix_hit_rate"], ".1f", 100), fmt(stats["num_compiled"], ".0f"),
    ]  # fmt: skip


def markdown_table(rows: list[dict]) -> str:
    """The main table: a row per workload, concurrency cap and system."""
    return _markdown(TABLE_HEADER, [table_cells(row) for row in rows], 2)


def turn_table(rows: list[dict]) -> str:
    """The multi-turn rows' TTFT of first and of returning turns (empty without such rows)."""
    rows = [r for r in rows if r["workload"] == "multi-turn" and "error" not in r]
    cells = [[
        system_title(row["system"]), fmt(row["output_tok_s"], ".1f"),
        f"{fmt(row['first_ttft_p50_s'], '.2f')} / {fmt(row['first_ttft_p99_s'], '.2f')}",
        f"{fmt(row['returning_ttft_p50_s'], '.2f')} / {fmt(row['returning_ttft_p99_s'], '.2f')}",
        fmt(row["stats"]["prefix_hit_rate"], ".1f", 100),
    ] for row in rows]  # fmt: skip
    return _markdown(TURN_HEADER, cells, 1) if rows else ""


def startup_table(rows: list[dict]) -> str:
    """Each row's start-up (its worker's process start to its first request: interpreter, imports,
    load, compilation, warm-up), kept out of the main table's clock as ``vllm bench throughput``
    keeps vLLM's engine start-up out of its own, beside the throughput and CPU per output token
    with it inside (a harness timing fresh processes from their start); empty without rows."""
    rows = [r for r in rows if "error" not in r]
    cells = [[
        workload_cell(row), system_title(row["system"]), fmt(row["startup_s"], ".1f"), fmt(row["output_tok_s"], ".1f"),
        fmt(row["end_to_end_tok_s"], ".1f"), fmt(row["cpu_ms_per_token"], ".1f"),
        fmt(row["cpu_ms_per_token_with_startup"], ".1f"),
    ] for row in rows]  # fmt: skip
    return _markdown(STARTUP_HEADER, cells, 2) if rows else ""


def speculation_table(rows: list[dict]) -> str:
    """The engine rows beside each speculating row: output tok/s (and as a multiple of ``engine``'s
    at the same workload and concurrency), TPOT and the draft counters of the run
    (``EngineStats.speculation``, the row's ``stats['speculation']``); empty without a speculating row."""
    if not any(r["system"] in SPECULATIVE_SYSTEMS for r in rows):
        return ""
    shown = [r for r in rows if r["system"] in ("engine", *SPECULATIVE_SYSTEMS) and "error" not in r]
    cells = [[
        workload_cell(row), system_title(row["system"]), fmt(row["output_tok_s"], ".1f"), _times_engine(row, rows),
        fmt(row["tpot_p50_ms"], ".1f"), str(spec["proposed"]), str(spec["accepted"]),
        fmt(spec["acceptance_rate"], ".1f", 100), fmt(spec["mean_accepted_length"], ".2f"),
    ] for row in shown for spec in [row["stats"]["speculation"]]]  # fmt: skip
    return _markdown(SPECULATION_HEADER, cells, 2)


def compaction_table(rows: list[dict]) -> str:
    """Compressed pages: the engine rows of each workload with an ``engine-compact-<pages>`` row,
    output tok/s (and as a multiple of ``engine``'s), the rows running after a step (mean over the
    steps and most), TTFT, TPOT, the K/V bytes a request holds at its longest
    (``kv_bytes_per_request``), compactions and preemptions; empty without such a row."""
    kinds = {r["workload"] for r in rows if compaction_pages(r["system"]) is not None}
    shown = [r for r in rows
             if r["workload"] in kinds and base_system(r["system"]) in ENGINE_SYSTEMS and "error" not in r]  # fmt: skip
    cells = [[
        workload_cell(row), system_title(row["system"]), fmt(row["output_tok_s"], ".1f"), _times_engine(row, rows),
        f"{fmt(stats['mean_running'], '.1f')} / {stats['peak_running']}", fmt(row["ttft_p50_s"], ".2f"),
        fmt(row["tpot_p50_ms"], ".1f"), fmt(stats["kv_bytes_per_request"], ".2f", 2**-20),
        str(stats["compactions"]), str(stats["preemptions"]),
    ] for row in shown for stats in [row["stats"]]]  # fmt: skip
    return _markdown(COMPACTION_HEADER, cells, 2) if kinds else ""


def print_report(title: str, table: str, targets: list[dict], summaries: dict[str, dict], rows: list[dict]) -> None:
    """The report on stdout: the workloads, the tables and the targets."""
    print(f"## Serving benchmark: {title}\n")
    for kind, summary in summaries.items():
        print(f"- {kind}: {summary['num_requests']} requests, {summary['prompt_tokens']} prompt tokens "
              f"({summary['distinct_prefix_tokens']} distinct prefixes) and {summary['output_tokens']} output "
              f"tokens, arrivals over {summary['arrival_span_s']:.1f} s")  # fmt: skip
    print()
    print(table)
    for heading, text in (("start-up (outside the clock above) and end to end", startup_table(rows)),
                          ("multi-turn, first and returning turns", turn_table(rows)),
                          ("speculative decoding in the engine", speculation_table(rows)),
                          ("compressed pages in the engine", compaction_table(rows))):  # fmt: skip
        if text:
            print(f"\n{heading}:\n\n{text}")
    print_targets(targets)
    backends = sorted({r["backend"] for r in rows if "error" not in r and r["system"] != "hf"})
    if backends and backends != ["cpu"]:
        print(f"\njaxkv ran on {backends}, transformers on the CPU (JAX_PLATFORMS=cpu compares like with like)")


def print_bounds(bounds: dict[str, dict]) -> None:
    """``--device gpu``: each workload's memory-bandwidth bound and the share of it each jaxkv row reached."""
    print("\n### Memory-bandwidth bound of the decode (--device gpu)\n")
    for kind, bound in bounds.items():
        fractions = ", ".join(f"{system_title(system)} {share:.1%}" for system, share in bound["fraction"].items())
        print(f"- {kind}: {bound['output_tok_s']:.1f} output tok/s at {bound['bandwidth_gbps']:.0f} GB/s "
              f"({bound['decode_steps']} steps: weights {bound['weight_bytes'] / 2**30:.1f} GiB, K/V "
              f"{bound['kv_bytes'] / 2**30:.1f} GiB); reached: {fractions}")  # fmt: skip


def json_settings(args: argparse.Namespace) -> dict:
    """The arguments as strict JSON: paths as strings, an infinite rate as null."""
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "worker"}
    return settings | {"rate": None if math.isinf(args.rate) else args.rate, "cpus": sorted(os.sched_getaffinity(0)),
                       "engine": dataclasses.asdict(args.engine)}  # fmt: skip


def row_name(row: dict) -> str:
    """The row's system, and its concurrency cap if it had one (the chart's labels)."""
    concurrency = row.get("max_concurrency")
    return system_title(row["system"]) + ("" if concurrency is None else f" @{concurrency}")


def plot(rows: list[dict], kinds: list[str], path: Path, title: str) -> None:
    """Per workload: output tok/s per system (bars) and each system's TTFT CDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(kinds), 2, figsize=(12, 4 * len(kinds)), squeeze=False)
    for (bars_ax, cdf_ax), kind in zip(axes, kinds):
        ok = [r for r in rows if r["workload"] == kind and "error" not in r]
        _throughput_bars(bars_ax, ok, f"{kind}: {title}")
        _ttft_cdfs(cdf_ax, ok, f"{kind}: TTFT CDF")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _throughput_bars(ax, rows: list[dict], title: str) -> None:
    bars = ax.bar([row_name(r) for r in rows], [r["output_tok_s"] for r in rows],
                  color=[system_color(r["system"]) for r in rows])  # fmt: skip
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=8)


def _ttft_cdfs(ax, rows: list[dict], title: str) -> None:
    for row in rows:
        ttft = np.sort([r["first_token"] - r["arrival"] for r in row["records"]])
        ax.step(ttft, np.arange(1, len(ttft) + 1) / len(ttft), where="post", label=row_name(row),
                color=system_color(row["system"]))  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    if rows:
        ax.legend(fontsize=8)


def write_outputs(out: Path, report: dict, kinds: list[str], title: str) -> None:
    """``--out`` (JSON) and, when matplotlib is installed, the chart next to it (``.png``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    png_path = out.with_suffix(".png")
    out.write_text(json.dumps(report, indent=2))
    if importlib.util.find_spec("matplotlib") is None:
        print(f"\nwrote {out}; no chart: matplotlib is not installed (pip install 'jaxkv[bench]')")
        return
    plot(report["rows"], kinds, png_path, title)
    print(f"\nwrote {out} and {png_path}")
