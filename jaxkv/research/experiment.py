"""``jaxkv experiment configs/experiments/NAME.yaml``: what a K/V cache policy costs in accuracy for
the memory it saves, as a grid of model x task (x its context lengths) x cache x budget x seed.

    jaxkv experiment configs/experiments/smoke.yaml --dry-run     # list the cells
    jaxkv experiment configs/experiments/passkey.yaml             # run what is not done yet
    jaxkv experiment configs/experiments/{passkey,retrieval,mqar}.yaml   # several grids in one run

A config (YAML, validated: an unknown key or a wrong type names the key and the file)::

    models: [smollm2, gemma3]          # jaxkv.models.load names, checkpoint directories or .gguf files
    dtype: float32
    seeds: [0, 1]
    budgets: [1.0, 0.5, 0.25]          # fractions of each task's context length, for eviction caches
    tasks:
      - {kind: passkey, contexts: [1024, 2048], depths: [0.1, 0.5, 0.9], examples: 2}
      - {kind: perplexity, contexts: [1024]}
    caches:
      - {name: full}                                             # the uncompressed cache
      - {name: int4, quantization: {nbits: 4, axis_key: -1}}     # jaxkv.quantization.QuantSpec
      - {name: snapkv, eviction: {policy: snapkv, window: 32}}   # EvictionSpec but its budget, below
      - {name: quest, retrieval: {budget: 256, page_size: 16}}   # jaxkv.retrieval.RetrievalSpec

Cells: the plain, quantized and retrieval caches (the last at their own budget of tokens per query)
run once per model, task context and seed; an eviction cache runs once per budget below 1.0, keeping
``max(1, int(budget * context))`` slots per row, K/V head and layer
(``jaxkv.eviction.EvictionSpec``; PyramidKV's mean over layers, its schedule planned for the task's
prompt length where every row's is equal, MQAR's context, else for the context:
``Task.prompt_length``). Budget 1.0 of any policy is the uncompressed cache, so it is the
plain cache's cell, not one per policy. Cells run model by model (each model loads once), then cache
by cache, each by capacity, across every grid of the command (``shape_order``): the cells of one
compiled shape run in a row and compile once. A retrieval task prefills each batch of contexts once
and refills every cache of the context from it (``jaxkv.research.tasks.ContextPrefills``), so a
context's first cell (its plain cache's) carries that prefill's seconds.

Outputs under ``OUTPUT_DIR/NAME/`` (NAME: the config file's stem): ``results.jsonl``, one line per
finished cell (its key, metrics, K/V bytes per row as ``cache.nbytes`` reports them, seconds),
appended as each cell ends: a run stopped midway resumes where it stopped, skipping finished cells
(a cell whose task or cache settings changed since runs again);
``summary.csv``, one row per model, task, context, cache and budget (the metric over seeds: mean
accuracy, or the perplexity of every prediction pooled); ``NAME.png``, the metric against K/V bytes,
one panel per model, task and context, a line per eviction policy through its budgets (starting at
the plain cache), the quantized formats as points on the same axes.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from jaxkv.config import EvictionPolicy, Strict, eviction_spec, load_config
from jaxkv.quantization import QuantSpec
from jaxkv.retrieval import RetrievalSpec
from jaxkv.research.tasks import KVRetrievalTask, MQARTask, PasskeyTask, PerplexityTask

Fraction = Annotated[float, Field(gt=0.0, le=1.0)]
TaskConfig = Annotated[PerplexityTask | PasskeyTask | KVRetrievalTask | MQARTask, Field(discriminator="kind")]


class CacheChoice(Strict):
    """One cache of the grid: plain (no option), quantized, evicting or retrieving pages."""

    name: str
    quantization: QuantSpec | None = None
    eviction: EvictionPolicy | None = None  # an EvictionSpec's fields but its budget (the grid's budgets)
    retrieval: RetrievalSpec | None = None

    @model_validator(mode="after")
    def _one_kind(self):
        given = [name for name in ("quantization", "eviction", "retrieval") if getattr(self, name) is not None]
        if len(given) > 1:
            both = " and ".join(given)
            raise ValueError(f"cache {self.name!r}: give one of quantization, eviction and retrieval, not {both}")
        return self

    @property
    def kind(self) -> str:
        kinds = {"eviction": self.eviction, "quantized": self.quantization, "retrieval": self.retrieval}
        return next((kind for kind, option in kinds.items() if option is not None), "full")

    def settings(self) -> dict:
        """The cache's fields as results.jsonl records them; ``retrieval`` only when given, so that
        the cells recorded before the option existed stay finished."""
        return self.model_dump(exclude=None if self.retrieval else {"retrieval"})

    def options(self, budget: float, context: int, prompt_length: int | None = None) -> dict:
        """The cache keywords (``model.init_cache``, ``generate``) of this cache at ``budget`` (a
        fraction of ``context`` tokens, eviction caches only); PyramidKV's schedule planned for
        ``prompt_length`` tokens (``Task.prompt_length``; None: the cache's length)."""
        if self.quantization is not None:
            return {"quantization": self.quantization}
        if self.retrieval is not None:
            return {"retrieval": self.retrieval}
        if self.eviction is None or budget >= 1.0:
            return {}
        spec = eviction_spec(self.eviction, slots(budget, context))
        if self.eviction["policy"] == "pyramidkv":
            spec = dataclasses.replace(spec, prompt_length=prompt_length)
        return {"eviction": spec}


class ExperimentConfig(Strict):
    """A grid of model x task x cache x budget x seed (see the module docstring)."""

    models: Annotated[list[str], Field(min_length=1)]
    dtype: Literal["float32", "bfloat16"] = "float32"
    tasks: Annotated[list[TaskConfig], Field(min_length=1)]
    caches: Annotated[list[CacheChoice], Field(min_length=1)]
    budgets: Annotated[list[Fraction], Field(min_length=1)] = [1.0]
    seeds: Annotated[list[int], Field(min_length=1)] = [0]

    @model_validator(mode="after")
    def _consistent(self):
        for what, names in (
            ("models", self.models), ("task names (name a task to list its kind twice)", [t.label for t in self.tasks]),
            ("cache names", [c.name for c in self.caches]), ("budgets", self.budgets), ("seeds", self.seeds),
        ):  # fmt: skip
            repeated = sorted({str(n) for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"{what} must be distinct; repeated: {', '.join(repeated)}")
        evicting = [c for c in self.caches if c.eviction is not None]
        fractions = [b for b in self.budgets if b < 1.0]
        if fractions and not evicting:
            raise ValueError("budgets below 1.0 apply to eviction caches only: add one or drop those budgets")
        if evicting and 1.0 in self.budgets and not any(c.kind == "full" for c in self.caches):
            raise ValueError(
                "budget 1.0 of an eviction policy is the uncompressed cache: add a plain cache ({name: full}) or "
                "drop budget 1.0"
            )
        contexts = {context for task in self.tasks for context in task.contexts}
        for cache, context, budget in itertools.product(evicting, sorted(contexts), fractions):
            try:  # a budget too small for the sinks and the window fails here, not mid-run
                eviction_spec(cache.eviction, slots(budget, context)).check_budget(slots(budget, context))
            except ValueError as error:
                raise ValueError(f"cache {cache.name!r} at budget {budget} of {context}: {error}") from error
        return self


def slots(budget: float, context: int) -> int:
    """Slots per row, K/V head and layer of an eviction cache at ``budget`` of ``context`` tokens."""
    return max(1, int(budget * context))


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the grid; its fields are its key in results.jsonl."""

    model: str
    task: str
    context: int
    cache: str
    budget: float
    seed: int

    def key(self) -> tuple:
        return dataclasses.astuple(self)

    def __str__(self) -> str:
        budget = "" if self.budget == 1.0 else f"@{self.budget:g}"
        return f"{self.model} {self.task} {self.context} {self.cache}{budget} seed {self.seed}"


def grid(config: ExperimentConfig) -> list[Cell]:
    """Every cell, listed model, task, context, cache, budget, seed (a run orders them by ``shape_order``)."""
    cells = []
    for model, task in model_tasks(config):
        for context in task.contexts:
            for cache in config.caches:
                budgets = sorted({b for b in config.budgets if b < 1.0}, reverse=True) if cache.eviction else [1.0]
                for budget in budgets:
                    cells += [Cell(model, task.label, context, cache.name, budget, seed) for seed in config.seeds]
    return cells


def model_tasks(config: ExperimentConfig) -> list[tuple[str, TaskConfig]]:
    """Each model with the tasks it runs: every pretrained model runs the text tasks; an ``mqar``
    task runs on its own checkpoint (the model's name in the cells is the checkpoint's path)."""
    text = [task for task in config.tasks if not isinstance(task, MQARTask)]
    pairs = [(model, task) for model in config.models for task in text]
    return pairs + [(task.checkpoint, task) for task in config.tasks if isinstance(task, MQARTask)]


def cell_settings(config: ExperimentConfig, cell: Cell) -> dict:
    """What a cell's result depends on beyond its key: the dtype and its task's and cache's settings."""
    return {"dtype": config.dtype, "task": task_of(config, cell).model_dump(), "cache": cache_of(config, cell).settings()}


def finished(config: ExperimentConfig, results: Path) -> dict[tuple, dict]:
    """The lines of ``results`` (results.jsonl) of ``config``'s cells that ran with the settings
    they have now, by cell key (a cell's latest line wins): a cell whose task or cache changed
    since (other depths, another window) runs again."""
    if not results.is_file():
        return {}
    wanted = {cell.key(): cell_settings(config, cell) for cell in grid(config)}
    fields = [field.name for field in dataclasses.fields(Cell)]
    done = {}
    for line in map(json.loads, filter(str.strip, results.read_text().splitlines())):
        key = tuple(line[field] for field in fields)
        if key in wanted and line.get("settings") == wanted[key]:
            done[key] = line
    return done


def run_experiment(config: ExperimentConfig, output: Path, *, progress: bool = True) -> list[dict]:
    """Run the cells of ``config`` not yet in ``output``/results.jsonl (``run_grids``); returns the
    summary rows."""
    return run_grids([(config, output)], progress=progress)[0]


def run_grids(grids: list[tuple[ExperimentConfig, Path]], *, progress: bool = True) -> list[list[dict]]:
    """Run the cells of each grid (a config and its output directory) not yet in its results.jsonl,
    appending each as it ends, in ``shape_order`` across the grids; then write each grid's summary CSV
    and plot. Returns each grid's summary rows."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from jaxkv.models.load import load_pretrained

    pending = []
    for index, (config, output) in enumerate(grids):
        output.mkdir(parents=True, exist_ok=True)
        done = finished(config, output / "results.jsonl")
        pending += [(index, cell) for cell in grid(config) if cell.key() not in done]
    loaded_name, loaded_setting, model, tokenizer, prepared = None, None, None, None, {}
    bar = tqdm(shape_order(grids, pending), desc="cells", unit="cell", disable=not progress, file=sys.stderr)
    for index, cell in bar:
        bar.set_postfix_str(str(cell))
        config, output = grids[index]
        task, cache, setting = task_of(config, cell), cache_of(config, cell), cache_setting(config, cell)
        if (cell.model, setting) != (loaded_name, loaded_setting):
            # Cells are ordered by model and cache: no executable of the last cache setting is of
            # use again. XLA's CPU backend keeps ~1200 memory mappings per compiled cache shape
            # until its executable is dropped; a run holding every cell's ran out of the kernel's
            # 65530 (LLVM "Cannot allocate memory", then a crash, after ~200 cells).
            jax.clear_caches()
            loaded_setting = setting
        if cell.model != loaded_name:  # cells are ordered by model: each loads once
            if isinstance(task, MQARTask):
                model, tokenizer = task.load()
            else:
                model, tokenizer = load_pretrained(cell.model, dtype=jnp.dtype(config.dtype))
            loaded_name, prepared = cell.model, {}
        if (index, cell.task) not in prepared:  # tasks of two grids may share a name
            prepared[index, cell.task] = task.prepare(tokenizer)
        start = time.perf_counter()
        options = cell_options(config, cell)
        metrics, kv_bytes = task.run(model, tokenizer, prepared[index, cell.task], cell.context, cell.seed, options)
        line = dataclasses.asdict(cell) | {
            "kind": cache.kind, "policy": cache.eviction["policy"] if cache.eviction else None,
            "metric": task.metric, "value": metrics[task.metric], "kv_bytes": kv_bytes,
            "seconds": time.perf_counter() - start, "metrics": metrics, "settings": cell_settings(config, cell),
        }  # fmt: skip
        with (output / "results.jsonl").open("a") as file:
            file.write(json.dumps(line) + "\n")
    return [write_summary(config, output) for config, output in grids]


def shape_order(grids: list[tuple[ExperimentConfig, Path]], cells: list[tuple[int, Cell]]) -> list[tuple[int, Cell]]:
    """``cells`` (grid index, cell) model by model (each model loads once, in the order the grids
    name them), and within a model cache by cache (in order of first appearance; one setting in
    two grids is one cache), each by its capacity (an eviction cache's slots, else the context).
    Cells of one compiled shape then run in a row, whatever their grid, task or context, and reuse
    the executables of the first (the driver keeps the last few): the passkey and retrieval tasks
    at 2k tokens, or SnapKV at half of 1k and a quarter of 2k, compile once. Python's sort is
    stable: otherwise the grids' own order."""
    models, caches, keys = {}, {}, []
    for index, cell in cells:
        cache, setting = cache_of(grids[index][0], cell), cache_setting(grids[index][0], cell)
        capacity = slots(cell.budget, cell.context) if cache.eviction and cell.budget < 1.0 else cell.context
        keys.append((models.setdefault(cell.model, len(models)), caches.setdefault(setting, len(caches)), capacity))
    return [item for _, item in sorted(zip(keys, cells), key=lambda pair: pair[0])]


def task_of(config: ExperimentConfig, cell: Cell) -> TaskConfig:
    return next(task for task in config.tasks if task.label == cell.task)


def cache_of(config: ExperimentConfig, cell: Cell) -> CacheChoice:
    return next(cache for cache in config.caches if cache.name == cell.cache)


def cell_options(config: ExperimentConfig, cell: Cell) -> dict:
    """The cache keywords of ``cell``: its cache's at its budget of its context, PyramidKV planned
    for its task's prompt length (``Task.prompt_length``)."""
    prompt_length = task_of(config, cell).prompt_length(cell.context)
    return cache_of(config, cell).options(cell.budget, cell.context, prompt_length)


def cache_setting(config: ExperimentConfig, cell: Cell) -> str:
    """The cell's cache setting whatever its name: equal in two grids means one cache."""
    return json.dumps(cache_of(config, cell).model_dump(exclude={"name"}), sort_keys=True)


def write_summary(config: ExperimentConfig, output: Path) -> list[dict]:
    """Summarize ``output``/results.jsonl into summary.csv and the plot; returns the summary rows."""
    rows = summarize(list(finished(config, output / "results.jsonl").values()))
    write_csv(rows, output / "summary.csv")
    if rows:
        plot(rows, output / f"{output.name}.png")
    return rows


def summarize(lines: list[dict]) -> list[dict]:
    """One row per model, task, context, cache and budget: the metric over seeds (accuracy: the
    mean, every seed has as many examples; perplexity: the geometric mean, i.e. the perplexity of
    every prediction pooled), K/V bytes per row, and both relative to the plain cache's cell."""
    groups = defaultdict(list)
    for line in lines:
        groups[(line["model"], line["task"], line["context"], line["cache"], line["budget"])].append(line)
    rows = []
    for (model, task, context, cache, budget), group in groups.items():
        first = group[0]
        values = [g["value"] for g in group]
        value = math.exp(sum(map(math.log, values)) / len(values)) if first["metric"] == "perplexity" else None
        rows.append({
            "model": model, "task": task, "context": context, "cache": cache, "kind": first["kind"],
            "policy": first["policy"] or "", "budget": budget, "metric": first["metric"],
            "value": value if value is not None else sum(values) / len(values), "seeds": len(group),
            "kv_bytes": sum(g["kv_bytes"] for g in group) / len(group),
            "seconds": sum(g["seconds"] for g in group),
        })  # fmt: skip
    full = {(r["model"], r["task"], r["context"]): r for r in rows if r["kind"] == "full"}
    for row in rows:
        base = full.get((row["model"], row["task"], row["context"]))
        row["kv_vs_full"] = row["kv_bytes"] / base["kv_bytes"] if base else ""
        row["value_vs_full"] = row["value"] / base["value"] if base and base["value"] else ""
    return sorted(
        rows, key=lambda r: (r["model"], r["task"], r["context"], r["kind"] != "full", r["cache"], -r["budget"])
    )


def write_csv(rows: list[dict], path: Path) -> None:
    fields = ["model", "task", "context", "cache", "kind", "policy", "budget", "metric", "value", "seeds",
              "kv_bytes", "kv_vs_full", "value_vs_full", "seconds"]  # fmt: skip
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def markdown(rows: list[dict]) -> str:
    """The summary as a markdown table (the README's)."""
    lines = ["| model | task | context | cache | budget | metric | value | K/V MiB per row | K/V vs full |",
             "|---|---|---:|---|---:|---|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        ratio = f"{r['kv_vs_full']:.3f}" if r["kv_vs_full"] != "" else ""
        lines.append(
            f"| {r['model']} | {r['task']} | {r['context']} | {r['cache']} | {r['budget']:g} | {r['metric']} | "
            f"{r['value']:.3f} | {r['kv_bytes'] / 2**20:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """The metric against K/V MiB per row: one panel per model and task (rows) and context
    (columns); a line per eviction policy through its budgets from the plain cache's point, a
    marker per quantized format and retrieval cache (which holds every token: its bytes are the
    plain cache's and its page summaries), a star for the plain cache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["task"]) for r in rows})
    contexts = sorted({r["context"] for r in rows})
    figure, axes = plt.subplots(
        len(panels), len(contexts), figsize=(4.5 * len(contexts), 3.6 * len(panels)), squeeze=False
    )
    for i, (model, task) in enumerate(panels):
        for j, context in enumerate(contexts):
            axis = axes[i][j]
            here = [r for r in rows if (r["model"], r["task"], r["context"]) == (model, task, context)]
            if not here:
                axis.set_visible(False)
                continue
            full = [r for r in here if r["kind"] == "full"]
            for r in full:
                axis.scatter(
                    r["kv_bytes"] / 2**20, r["value"], marker="*", s=140, color="black", label=r["cache"], zorder=3
                )
            for cache in sorted({r["cache"] for r in here if r["kind"] == "eviction"}):
                points = sorted((r for r in here if r["cache"] == cache), key=lambda r: -r["budget"])
                points = full[:1] + points
                axis.plot(
                    [p["kv_bytes"] / 2**20 for p in points], [p["value"] for p in points], marker="o", label=cache
                )
            quantized = [r for r in here if r["kind"] in ("quantized", "retrieval")]
            for index, r in enumerate(quantized):  # colors after the policies' lines: one color per cache
                color = f"C{(len(axis.lines) + index) % 10}"
                axis.scatter(r["kv_bytes"] / 2**20, r["value"], marker="s", color=color, label=r["cache"], zorder=3)
            metric = here[0]["metric"]
            axis.set(title=f"{model}, {task}, {context} tokens", xlabel="K/V MiB per sequence", ylabel=metric)
            axis.set_xscale("log")
            if metric == "accuracy":  # one scale on every panel, so panels compare at a glance
                axis.set_ylim(-0.05, 1.05)
            axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def list_cells(config: ExperimentConfig, output: Path) -> str:
    """``--dry-run``: every cell, each marked done (in results.jsonl) or to run, and the counts."""
    done = finished(config, output / "results.jsonl")
    cells = grid(config)
    lines = [f"{'done' if cell.key() in done else 'todo'}  {cell}" for cell in cells]
    todo = sum(cell.key() not in done for cell in cells)
    return "\n".join(lines + [f"{len(cells)} cells, {todo} to run, results in {output}"])


def run_command(paths: list[Path], output_dir: Path, *, dry_run: bool = False) -> int:
    """``jaxkv experiment PATH...``: the grids' cells not yet finished (each grid's into
    ``output_dir``/NAME, in one ``run_grids``), then each grid's summary and plot; ``dry_run``:
    list the cells. Every config is validated before the
    first cell runs, so a typo in the last grid fails at once, not after the others."""
    grids = [(load_config(path, ExperimentConfig), output_dir / path.stem) for path in paths]
    if dry_run:
        print("\n".join(list_cells(config, output) for config, output in grids))
        return 0
    for (config, output), rows in zip(grids, run_grids(grids)):
        print(markdown(rows))
        print(f"wrote {output / 'results.jsonl'}, {output / 'summary.csv'} and {output / (output.name + '.png')}")
    return 0
