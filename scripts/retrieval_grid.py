"""Issue 42's experiment grid as one table and one plot: accuracy against the K/V bytes a cache keeps
on the device, from the results of ``jaxkv experiment`` (``results.jsonl``; configs/experiments/
retrieval-grid-{2k,4k}.yaml).

    .venv/bin/jaxkv experiment configs/experiments/retrieval-grid-{2k,4k}.yaml --output-dir results
    .venv/bin/python scripts/retrieval_grid.py results/retrieval-grid-{2k,4k} --plot docs/figures/retrieval-grid.png

Device bytes per row: a plain, quantized or evicting cache's own ``kv_bytes`` (what it holds); a
retrieval cache's ``budget`` tokens of K/V and its page summaries, what a step reads and all it needs
on the device once the bulk lives in host memory (this layer still holds every token on the device:
its held bytes are printed too); its ``dense_layers`` first layers read every token, so they need the
whole context on the device (with their unused summaries). The device tokens per layer: the context
(plain and quantized caches), the slots an evicting cache keeps per layer (on average), and for retrieval
the mean over the ``--layers`` layers of the budget (retrieving) and the context (dense layers). The
goal line compares each cell with the plain cache's accuracy.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

SUMMARY_ROWS = {"minmax": 2, "centroid": 1}  # page summary vectors (jaxkv.layers.retrieval)
GOAL_RETRIEVAL, GOAL_EVICTION = 0.95, 0.70  # of the plain cache's accuracy (issue 42)


def device_tokens(line: dict, layers: int) -> float:
    """The tokens of K/V per layer and K/V head ``line``'s cache keeps on the device, the mean over ``layers``."""
    spec = line["settings"]["cache"].get("retrieval")
    if spec is None:  # plain and quantized caches: the context; evicting ones: its fraction (PyramidKV's mean)
        return line["context"] * (line["budget"] if line["kind"] == "eviction" else 1.0)
    dense = spec.get("dense_layers", 0)
    return (dense * line["context"] + (layers - dense) * spec["budget"]) / layers


def device_bytes(line: dict, full_bytes: float, layers: int) -> float:
    """The bytes per row ``line``'s cache needs on the device (see the module docstring)."""
    spec = line["settings"]["cache"].get("retrieval")
    if spec is None:
        return line["kv_bytes"]
    per_token = full_bytes / line["context"]  # K and V of one token over every layer and K/V head
    summaries = SUMMARY_ROWS[spec["summary"]] * (line["context"] // spec["page_size"]) * per_token / 2
    return device_tokens(line, layers) * per_token + summaries


def rows(directories: list[Path], layers: int) -> list[dict]:
    """One row per (task, context, cache): accuracy, device tokens per layer, device and held MiB, the
    share of the plain cache's accuracy (``layers``: the model's)."""
    lines = [json.loads(text) for d in directories for text in (d / "results.jsonl").read_text().splitlines() if text]
    full = {(x["task"], x["context"]): x for x in lines if x["kind"] == "full"}
    out = []
    for x in lines:
        base = full[x["task"], x["context"]]
        out.append({
            "task": x["task"], "context": x["context"], "cache": x["cache"], "kind": x["kind"],
            "policy": x["policy"], "accuracy": x["value"], "examples": x["metrics"]["num_examples"],
            "device_mib": device_bytes(x, base["kv_bytes"], layers) / 2**20, "held_mib": x["kv_bytes"] / 2**20,
            "device_tokens": device_tokens(x, layers),
            "of_full": x["value"] / base["value"] if base["value"] else float("nan"),
        })  # fmt: skip
    return sorted(out, key=lambda r: (r["task"], r["context"], -r["device_mib"], r["cache"]))


def markdown(table: list[dict]) -> str:
    head = (
        "| task | context | cache | accuracy | of full | device tokens/layer | device MiB/row | held MiB/row |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|"
    )
    body = [
        f"| {r['task']} | {r['context']} | {r['cache']} | {r['accuracy']:.2f} ({r['examples']}) | "
        f"{r['of_full']:.2f} | {r['device_tokens']:.0f} | {r['device_mib']:.2f} | {r['held_mib']:.2f} |"
        for r in table
    ]
    return "\n".join([head, *body])


def goal(table: list[dict]) -> str:
    """Per task and context: the best retrieval and the best eviction cache against the plain cache's accuracy."""
    cells = defaultdict(list)
    for r in table:
        cells[r["task"], r["context"]].append(r)
    lines = []
    for (task, context), here in sorted(cells.items()):
        best = {kind: max((r for r in here if r["kind"] == kind), key=lambda r: r["accuracy"], default=None)
                for kind in ("retrieval", "eviction")}  # fmt: skip
        if None in best.values():
            continue
        met = best["retrieval"]["of_full"] >= GOAL_RETRIEVAL and best["eviction"]["of_full"] < GOAL_EVICTION
        lines.append(
            f"{task} {context}: retrieval ({best['retrieval']['cache']}) {best['retrieval']['of_full']:.2f} of full, "
            f"best eviction ({best['eviction']['cache']}) {best['eviction']['of_full']:.2f}: goal {'met' if met else 'not met'}"
        )
    return "\n".join(lines)


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["task"], r["context"]) for r in table})
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    markers = {"full": "D", "retrieval": "*", "eviction": "o", "quantized": "s"}
    colors = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(r["cache"] for r in table))}  # one per cache
    for axis, (task, context) in zip(axes[0], panels):
        for r in (r for r in table if (r["task"], r["context"]) == (task, context)):
            axis.scatter(r["device_mib"], r["accuracy"], marker=markers[r["kind"]], s=120 if r["kind"] == "retrieval" else 50,
                         color=colors[r["cache"]], label=r["cache"], zorder=3)  # fmt: skip
        axis.set(xscale="log", title=f"SmolLM2-135M {task}, {context} tokens", xlabel="device K/V MiB per row",
                 ylabel="accuracy", ylim=(-0.05, 1.05))  # fmt: skip
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="jaxkv experiment output directories")
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    parser.add_argument("--layers", type=int, default=30, help="the model's layers (SmolLM2-135M: 30)")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    table = rows(args.results, args.layers)
    print(markdown(table), goal(table), sep="\n\n")
    if args.plot:
        plot(table, args.plot)


if __name__ == "__main__":
    main()
