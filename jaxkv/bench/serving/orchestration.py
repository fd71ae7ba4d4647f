"""Running the serving benchmark: every system on every workload in a fresh worker process (vLLM's
under the python of its own venv), ``--repeat`` rounds of them, a busy loop beside each worker with
``--competing-cpu``, and one row per system from its runs."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxkv.bench import vllm_worker
from jaxkv.bench.bandwidth import measure_bandwidth
from jaxkv.bench.common import run_worker as run_process
from jaxkv.bench.serving.metrics import add_agreement, make_row, run_metrics
from jaxkv.bench.serving.spec import WorkerSpec, worker_spec
from jaxkv.bench.serving.systems import VLLM_SYSTEMS
from jaxkv.bench.vllm_env import VllmUnavailable, ensure_checkpoint, ensure_venv

MODULE = "jaxkv.bench.serving"  # workers run as `python -m MODULE --worker SPEC`
BUSY_LOOP = "while True: pass"  # the competing process of --competing-cpu
GPU_BANDWIDTH_MIB = 512  # the array the GPU's bandwidth is measured on


@dataclasses.dataclass(frozen=True)
class VllmSetup:
    """What the vLLM systems run on: the python of vLLM's venv and the float32 checkpoint folder
    (which the jaxkv systems load too, so every system runs the same weights)."""

    python: Path
    checkpoint: Path


def prepare_vllm(args: argparse.Namespace) -> tuple[VllmSetup | None, dict[str, str]]:
    """With a vLLM system selected: its venv and the checkpoint folder (made on first use), and
    ``{}``; or, when the venv cannot be made, None and each vLLM system's reason to be skipped."""
    wanted = [s for s in args.systems if s in VLLM_SYSTEMS]
    if not wanted:
        return None, {}
    try:
        python = ensure_venv(args.vllm_venv)
    except VllmUnavailable as error:
        reason = f"vLLM is unavailable, so {', '.join(wanted)} are skipped: {error}"
        print(f"[bench] {reason}", file=sys.stderr, flush=True)
        return None, dict.fromkeys(wanted, reason)
    return VllmSetup(python, ensure_checkpoint(args.model)), {}


def measure_gpu_bandwidth(args: argparse.Namespace) -> dict:
    """The GPU's memory bandwidth (a jitted sum in a fresh worker); ``{"error": ...}`` without one."""
    return measure_bandwidth(GPU_BANDWIDTH_MIB, "gpu", label="GPU memory bandwidth", timeout=args.worker_timeout,
                             verbose=args.verbose)  # fmt: skip


def worker_command(spec: WorkerSpec, vllm: VllmSetup | None) -> list[str]:
    """What runs a spec (its JSON file follows): jaxkv's systems this package under this python,
    vLLM's ``vllm_worker.py`` under its venv's python."""
    if spec.system in VLLM_SYSTEMS:
        return [str(vllm.python), str(Path(vllm_worker.__file__))]
    return [sys.executable, "-m", MODULE, "--worker"]


def run_worker(spec: WorkerSpec, vllm: VllmSetup | None, *, timeout: float | None, verbose: bool) -> dict:
    """``spec`` run by a fresh worker; its result, or ``{"error": ...}``."""
    return run_process(worker_command(spec, vllm), spec.model_dump(mode="json"), label=spec.label,
                       device=spec.device, timeout=timeout, verbose=verbose)  # fmt: skip


def run_after_restart(spec: WorkerSpec, vllm: VllmSetup | None, *, timeout: float | None, verbose: bool) -> dict:
    """``engine-disk-tier``: a first worker serves the workload with a fresh ``kv_cache_dir``
    (its result dropped), a second one, the restarted server, is the timed run on that directory."""
    with tempfile.TemporaryDirectory(prefix="bench-kv-cache-") as directory:
        spec = spec.model_copy(update=dict(engine=dataclasses.replace(spec.engine, kv_cache_dir=directory)))
        filling = spec.model_copy(update=dict(label=f"{spec.label} (filling the disk tier)"))
        filled = run_worker(filling, vllm, timeout=timeout, verbose=verbose)
        return filled if "error" in filled else run_worker(spec, vllm, timeout=timeout, verbose=verbose)


@contextlib.contextmanager
def competing_process(cpu: int | None):
    """A busy loop pinned to CPU ``cpu`` while the block runs, yielded as its ``Popen`` (None
    and nothing started for None): the rows "under a competing process on one core", started
    and stopped around every worker."""
    if cpu is None:
        yield None
        return
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        os.sched_setaffinity(busy.pid, {cpu})  # after the start: a preexec_fn would fork this threaded process
        yield busy
    finally:
        busy.kill()
        busy.wait()


def run_once(args: argparse.Namespace, spec: WorkerSpec, vllm: VllmSetup | None) -> dict:
    """One run in a fresh worker (beside a busy loop with ``--competing-cpu``): its result with
    its metrics (``run_metrics``) and the machine's 1-minute load average as it started."""
    load = os.getloadavg()[0]
    run = run_after_restart if spec.system == "engine-disk-tier" else run_worker
    with competing_process(args.competing_cpu):
        result = run(spec, vllm, timeout=args.worker_timeout, verbose=args.verbose)
    result |= dict(load_1min=load)
    return result if "error" in result else result | run_metrics(result, [r.turn for r in spec.requests])


def run_all(args: argparse.Namespace, workloads: dict, vllm: VllmSetup | None) -> list[dict]:
    """Per workload (and per ``--max-concurrency`` cap), ``--repeat`` rounds of every system (a
    fresh worker each), then one row per system."""
    checkpoint = None if vllm is None else vllm.checkpoint
    rows = []
    for kind, requests in workloads.items():
        for concurrency in args.max_concurrency or [None]:
            specs = {s: worker_spec(args, s, kind, requests, checkpoint, concurrency) for s in args.systems}
            runs = {system: [] for system in args.systems}
            for _ in range(args.repeat):
                for system, spec in specs.items():
                    runs[system].append(run_once(args, spec, vllm))
            rows += [make_row(kind, system, runs[system], concurrency) for system in args.systems]
    add_agreement(rows)
    return rows
