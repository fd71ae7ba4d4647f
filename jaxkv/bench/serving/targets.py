"""The serving benchmark's targets, as data: ``docs/benchmark-targets.yaml`` (its ``serving`` list)
names for each target the rows it reads, the metric, the comparison and the threshold; a run's
rows are checked against them."""

from __future__ import annotations

import fnmatch
import operator
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from jaxkv.bench.serving.metrics import REPEATED_METRICS, STAT_KEYS, find_row
from jaxkv.bench.serving.systems import COMPACT_PREFIX, SYSTEMS, workload_label
from jaxkv.bench.serving.workloads import WORKLOADS

TARGETS_FILE = Path(__file__).resolve().parents[3] / "docs" / "benchmark-targets.yaml"
COMPARISONS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
STATS = "stats."  # a metric of a row's statistics: stats.<key>
EACH_COMPACT = COMPACT_PREFIX + "*"  # the system of a target checked on every engine-compact-<pages> row


class Target(BaseModel):
    """One target: ``metric`` of ``system``'s row on ``workload`` (at ``concurrency``), divided by
    ``over``'s when it names a system, compared with ``threshold``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """What it measures, as printed; ``{threshold}`` and ``{system}`` are filled in."""
    workload: str
    system: str
    """The measured system; ``engine-compact-*``: one target per such row of the run."""
    over: str | None = None
    """The system whose metric the value is divided by (None: the metric itself)."""
    metric: str
    """A row's metric (``output_tok_s``) or one of its statistics (``stats.wasted_slot_fraction``)."""
    concurrency: int | None = None
    """The rows' cap on requests in flight (None: uncapped rows)."""
    compare: Literal[">=", "<=", ">", "<"]
    threshold: float
    display: str = "{value:.2f}x"
    """How the value prints."""
    note: str
    """Where the target comes from (the issue) and why the threshold."""

    @field_validator("workload")
    @classmethod
    def _known_workload(cls, workload: str) -> str:
        if workload not in WORKLOADS:
            raise ValueError(f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)}")
        return workload

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, metric: str) -> str:
        if metric not in REPEATED_METRICS and metric.removeprefix(STATS) not in STAT_KEYS:
            raise ValueError(f"unknown metric {metric!r}: one of {', '.join(REPEATED_METRICS)} or "
                             f"{STATS}<key> for a key of {', '.join(STAT_KEYS)}")  # fmt: skip
        return metric

    @model_validator(mode="after")
    def _known_systems(self) -> Target:
        unknown = [s for s in (self.system, self.over) if s is not None and s not in SYSTEMS and s != EACH_COMPACT]
        if unknown:
            raise ValueError(f"unknown system {unknown[0]!r}: one of {', '.join(SYSTEMS)} or {EACH_COMPACT}")
        return self


def load_targets(path: Path = TARGETS_FILE) -> list[Target]:
    """The targets of ``path``'s ``serving`` list, in order; none where the file is absent (an
    installed jaxkv without the source checkout's docs)."""
    if not path.is_file():
        return []
    return [Target.model_validate(entry) for entry in yaml.safe_load(path.read_text())["serving"]]


def check_targets(rows: list[dict], targets: list[Target] | None = None) -> list[dict]:
    """Each target (``load_targets()`` by default) on ``rows``: its name, value, display and verdict
    (None: not measured)."""
    targets = load_targets() if targets is None else targets
    return [_result(target, system, rows) for target in targets for system in _systems(target, rows)]


def _systems(target: Target, rows: list[dict]) -> list[str]:
    """The systems a target is checked on: its own, or each successful row's that its pattern matches."""
    if target.system != EACH_COMPACT:
        return [target.system]
    return [r["system"] for r in rows if (r["workload"], r.get("max_concurrency")) == (target.workload,
            target.concurrency) and fnmatch.fnmatchcase(r["system"], target.system) and "error" not in r]  # fmt: skip


def _result(target: Target, system: str, rows: list[dict]) -> dict:
    value = _value(target, system, rows)
    name = target.name.format(threshold=target.threshold, system=system)
    return dict(
        target=f"{workload_label(target.workload, target.concurrency)}: {name}", value=value,
        display="not measured" if value is None else target.display.format(value=value),
        passed=None if value is None else COMPARISONS[target.compare](value, target.threshold),
    )  # fmt: skip


def _value(target: Target, system: str, rows: list[dict]) -> float | None:
    """The target's metric of ``system``, over ``target.over``'s when it names one; None when either is missing."""
    value = _metric(target, system, rows)
    if target.over is None or value is None:
        return value
    base = _metric(target, target.over, rows)
    return None if base is None else value / base


def _metric(target: Target, system: str, rows: list[dict]) -> float | None:
    row = find_row(rows, target.workload, system, target.concurrency)
    if row is None:
        return None
    if target.metric.startswith(STATS):
        return row["stats"].get(target.metric.removeprefix(STATS))
    return row.get(target.metric)
