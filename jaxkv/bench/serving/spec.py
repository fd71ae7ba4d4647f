"""What a serving worker runs: ``WorkerSpec``, one system on one workload, written as JSON to the
worker process (vLLM's worker, which cannot import jaxkv, reads the same JSON as a dict)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from jaxkv.bench.serving.metrics import STAT_KEYS
from jaxkv.bench.serving.systems import ON_GPU, VLLM_SYSTEMS, base_system, system_engine
from jaxkv.bench.vllm_env import CPU_DEFAULT_BLOCK_SIZE, engine_args, kv_bytes_per_token
from jaxkv.bench.vllm_worker import ServingRequest
from jaxkv.serving.engine_config import EngineConfig
from jaxkv.serving.sizing import parse_bytes


class WorkerSpec(BaseModel):
    """One system on one workload, as its worker process runs it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    system: str
    """The system (``jaxkv.bench.serving.systems``), ``engine-compact-<pages>`` included."""
    workload: str
    label: str
    """The run's name in the parent's progress lines."""
    model: str
    """The model every system loads (with vLLM among the systems, its float32 checkpoint folder)."""
    dtype: str
    device: str
    """Where JAX runs: ``gpu`` for jaxkv's systems under ``--device gpu``, else ``cpu``."""
    threads: int
    """torch's threads (transformers)."""
    requests: tuple[ServingRequest, ...]
    engine: EngineConfig
    """The engine this system runs (``systems.system_engine``; its draft model a name); its pool,
    page size and batch limits are also transformers' and vLLM-matched's."""
    max_concurrency: int | None = None
    """The engine's cap on requests in flight (None: none)."""
    static_batch: int
    """Requests per batch of ``static``."""
    max_output: int
    """The workload's longest output (transformers' generation limit)."""
    engine_args: dict | None = None
    """vLLM's ``EngineArgs`` (the vLLM systems)."""
    warm_up_requests: int = 0
    """Requests vLLM serves before its timer (``--vllm-warm-up-requests``; none by default, as
    ``vllm bench throughput``: its engine's start-up runs its own warm-up)."""
    stat_keys: tuple[str, ...] = STAT_KEYS
    """The statistics a row reports (vLLM's worker fills what it measures)."""


def worker_spec(args: argparse.Namespace, system: str, kind: str, requests: list[ServingRequest],
                checkpoint: Path | None, concurrency: int | None = None) -> WorkerSpec:  # fmt: skip
    """``system``'s spec on workload ``kind`` (``concurrency``: the engine's cap on requests in flight,
    None: none). With vLLM among the systems every system loads its ``checkpoint`` folder."""
    model = args.model if checkpoint is None else str(checkpoint)
    vllm = _vllm_fields(args, system, requests, checkpoint) if system in VLLM_SYSTEMS else {}
    return WorkerSpec(
        system=system, workload=kind, label=run_label(kind, system, concurrency), model=model, dtype=args.dtype,
        device=args.device if base_system(system) in ON_GPU else "cpu", threads=args.threads, requests=requests,
        engine=system_engine(args.engine, system, args.speculation, model), max_concurrency=concurrency,
        static_batch=args.static_batch, max_output=args.max_output, **vllm,
    )  # fmt: skip


def _vllm_fields(args: argparse.Namespace, system: str, requests: list[ServingRequest], checkpoint: Path) -> dict:
    """A vLLM system's engine arguments and warm-up requests. ``vllm``'s K/V pool is jaxkv's
    (``--kv-memory``) or, when larger, ``whole_workload_bytes``: vLLM's default pool (most of the
    machine's memory) would hold the whole workload, so vLLM at its defaults never preempts."""
    engine = args.engine
    kv_memory = parse_bytes(engine.kv_memory)
    if system == "vllm":
        kv_memory = max(kv_memory, whole_workload_bytes(requests, kv_bytes_per_token(checkpoint, args.dtype)))
    vllm_args = engine_args(
        system, checkpoint, kv_memory_bytes=kv_memory, page_size=engine.page_size,
        max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
    )  # fmt: skip
    return dict(engine_args=vllm_args, warm_up_requests=min(args.vllm_warm_up_requests, len(requests)))


def whole_workload_bytes(requests: list[ServingRequest], token_bytes: int,
                         block_size: int = CPU_DEFAULT_BLOCK_SIZE) -> int:  # fmt: skip
    """K/V bytes in blocks of ``block_size`` tokens (``token_bytes`` a token) holding every request's
    prompt and output at once."""
    blocks = sum(-(-(len(r.prompt) + r.max_tokens) // block_size) for r in requests)
    return blocks * block_size * token_bytes


def run_label(kind: str, system: str, concurrency: int | None) -> str:
    """A run's name in the progress lines."""
    return f"{kind} / {system}" + ("" if concurrency is None else f" / concurrency {concurrency}")
