"""The serving benchmark's request driver, and its vLLM worker.

Standard library and psutil only at import (vLLM's own venv has psutil, a vLLM dependency; jaxkv
is not installed there), so the same file serves two roles:

* imported as ``jaxkv.bench.vllm_worker`` by ``jaxkv.bench.serving``: the requests and records
  every worker shares, the clock, ``drive`` (requests enter an engine only once their arrival
  time has passed; one step at a time) and ``process_tree_cpu_seconds``;
* run as a file by the python of vLLM's venv (``jaxkv.bench.vllm_env``):
  ``python vllm_worker.py SPEC.json`` builds vLLM's engine as ``vllm bench throughput`` does
  (``LLM.from_engine_args(EngineArgs(...))``: the ``LLM`` class's defaults, whose engine start-up
  runs vLLM's own warm-up), serves ``spec['warm_up_requests']`` requests first (none by default,
  as that benchmark's ``--num-warmups``), drives the workload through ``llm.llm_engine`` with the
  same ``drive`` and writes the records, the generated token ids and the CPU seconds to
  ``spec['result_path']`` (JSON).

vLLM's engine core runs in a child process (V1 multiprocessing); the worker's CPU seconds are
its whole process tree's. vLLM spawns processes, hence the ``__main__`` guard.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import psutil

WARM_UP_TOKENS = 2  # tokens each warm-up request generates (its prefill is the point)


@dataclasses.dataclass(frozen=True)
class ServingRequest:
    """One request of a workload: when it arrives (seconds after the run start), its prompt
    (token ids) and exactly how many tokens it generates."""

    arrival: float
    prompt: list[int]
    max_tokens: int
    turn: int = 0  # multi-turn: the conversation's turn (0: its first request)


@dataclasses.dataclass(frozen=True)
class Record:
    """What one request saw, in seconds since the run start."""

    arrival: float
    first_token: float
    finish: float
    output_tokens: int


class Clock:
    """Seconds since the run started; waits for arrivals."""

    def __init__(self):
        self.start = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def since_start(self, perf_counter_time: float) -> float:
        return perf_counter_time - self.start

    def sleep_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)


class TokenTally:
    """A request's first-token and finish times and its token ids, from outputs seen as they come."""

    def __init__(self, arrival: float):
        self.arrival = arrival
        self.first_token: float | None = None
        self.finish: float | None = None
        self.token_ids: list[int] = []

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    def observe(self, now: float, new_token_ids: Sequence[int], finished: bool) -> None:
        if new_token_ids and self.first_token is None:
            self.first_token = now
        self.token_ids += new_token_ids
        if finished:
            self.finish = now

    def record(self) -> Record:
        if self.first_token is None or self.finish is None:
            raise RuntimeError(f"a request arriving at {self.arrival:.3f} s never finished ({self.tokens} tokens)")
        return Record(self.arrival, self.first_token, self.finish, self.tokens)


def check_lengths(records: list[Record], requests: list[ServingRequest], system: str) -> None:
    """Every request generated exactly its drawn number of tokens (end-of-sequence is ignored)."""
    wrong = [(i, r.output_tokens, q.max_tokens) for i, (r, q) in enumerate(zip(records, requests))
             if r.output_tokens != q.max_tokens]  # fmt: skip
    if wrong:
        raise RuntimeError(f"{system}: requests (index, generated, asked) {wrong[:5]} did not generate as asked")


class Driven(Protocol):
    """An engine as ``drive`` sees it: requests go in by index, outputs come out by index."""

    def submit(self, index: int, request: ServingRequest) -> None: ...

    def step(self) -> list[tuple[int, list[int], bool]]:
        """One engine step: ``(index, new token ids, finished)`` per request with news."""
        ...

    def busy(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class DriveResult:
    """``drive``'s result: one record and the generated token ids per request, in request order."""

    records: list[Record]
    token_ids: list[list[int]]


def drive(engine: Driven, requests: list[ServingRequest]) -> DriveResult:
    """Submit each request once its arrival time has passed; step while any is unfinished (sleeping
    until the next arrival when none is)."""
    clock = Clock()
    pending = collections.deque(range(len(requests)))
    tallies = [TokenTally(r.arrival) for r in requests]
    while pending or engine.busy():
        while pending and requests[pending[0]].arrival <= clock.now():
            i = pending.popleft()
            engine.submit(i, requests[i])
        if not engine.busy():
            clock.sleep_until(requests[pending[0]].arrival)
            continue
        outputs = engine.step()
        now = clock.now()
        for i, new_token_ids, finished in outputs:
            tallies[i].observe(now, new_token_ids, finished)
    return DriveResult([t.record() for t in tallies], [t.token_ids for t in tallies])


def process_tree_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and its live descendants, each with its reaped
    children's: a difference of two readings is the tree's CPU time between them."""
    root = psutil.Process()
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:  # ended between the listing and the reading
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def startup() -> dict:
    """The worker's start-up so far, called as its timed run starts: wall seconds since its process
    was created (interpreter, imports, model load, compilation, warm-up: what a server does before
    it serves) and its process tree's CPU seconds (``startup_s``, ``startup_cpu_s``)."""
    return dict(startup_s=time.time() - psutil.Process().create_time(), startup_cpu_s=process_tree_cpu_seconds())


def timed_drive(engine: Driven, requests: list[ServingRequest], system: str) -> dict:
    """``drive`` with the lengths checked, the process tree's CPU seconds counted over it: the
    worker result's ``records``, ``token_ids`` and ``cpu_s``, with its ``startup()``."""
    ready = startup()
    run = drive(engine, requests)
    cpu_seconds = process_tree_cpu_seconds() - ready["startup_cpu_s"]
    check_lengths(run.records, requests, system)
    return dict(records=run.records, token_ids=run.token_ids, cpu_s=cpu_seconds, **ready)


def warm_up_requests(requests: list[ServingRequest], count: int) -> list[ServingRequest]:
    """``count`` requests ahead of the timer: the first prompts reversed (no page of them is a
    prefix of a timed prompt, so a prefix cache gains nothing), all arriving at once, each
    generating ``WARM_UP_TOKENS``."""
    return [ServingRequest(0.0, r.prompt[::-1], WARM_UP_TOKENS) for r in requests[:count]]


# ----------------------------------------------------------------------------------------------
# vLLM


class VllmRequests:
    """``vllm.LLMEngine`` (V1) as ``drive`` sees it: request ``i`` is ``f"{prefix}{i}"``, its
    prompt token ids go in as a tokens prompt, and ``params(max_tokens)`` are its sampling
    parameters (``DELTA`` outputs: each output carries only its new token ids)."""

    def __init__(self, engine, params: Callable[[int], Any], prefix: str = ""):
        self.engine = engine
        self.params = params
        self.prefix = prefix

    def submit(self, index: int, request: ServingRequest) -> None:
        self.engine.add_request(f"{self.prefix}{index}", {"prompt_token_ids": request.prompt},
                                self.params(request.max_tokens))  # fmt: skip

    def step(self) -> list[tuple[int, list[int], bool]]:
        return [(int(out.request_id.removeprefix(self.prefix)), list(out.outputs[0].token_ids), out.finished)
                for out in self.engine.step()]  # fmt: skip

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


def greedy_params(max_tokens: int):
    """Greedy, exactly ``max_tokens`` tokens (end-of-sequence ignored), new ids only, no text."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.DELTA)  # fmt: skip


def engine_settings(engine) -> dict:
    """The settings vLLM resolved (its defaults where the spec left them out), its K/V pool in
    blocks, its CPU thread binding (``VLLM_CPU_OMP_THREADS_BIND``, "auto" unless set: its compute
    bound to the usable cores less one reserved for its scheduler) and which of its kernel builds
    it loads: ``vllm/platforms/cpu.py`` imports ``_C_AVX512`` where torch reports AVX-512, else
    ``_C_AVX2`` (its attention and its fused ops are the build's)."""
    import os

    import torch

    config = engine.vllm_config
    return dict(
        cpu_kernels="AVX512" if torch.cpu._is_avx512_supported() else "AVX2",
        block_size=config.cache_config.block_size, enable_prefix_caching=config.cache_config.enable_prefix_caching,
        num_kv_blocks=config.cache_config.num_gpu_blocks,
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        enable_chunked_prefill=config.scheduler_config.enable_chunked_prefill, dtype=str(config.model_config.dtype),
        omp_threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        reserved_cpus=os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
    )  # fmt: skip


def run_vllm(spec: dict) -> dict:
    """Start the engine as ``vllm bench throughput`` does, serve ``spec['warm_up_requests']``
    requests (none by default), then the timed run."""
    import vllm
    from vllm import LLM, EngineArgs

    requests = [ServingRequest(**r) for r in spec["requests"]]
    start = time.perf_counter()
    engine = LLM.from_engine_args(EngineArgs(**spec["engine_args"])).llm_engine
    try:
        if spec["warm_up_requests"]:
            warm_up = warm_up_requests(requests, spec["warm_up_requests"])
            drive(VllmRequests(engine, greedy_params, "warm-up-"), warm_up)
        warmup_seconds = time.perf_counter() - start
        result = timed_drive(VllmRequests(engine, greedy_params), requests, spec["system"])
        settings = engine_settings(engine)
    finally:
        engine.engine_core.shutdown()  # the engine core process
    kv_bytes = spec["engine_args"]["kv_cache_memory_bytes"]
    stats = dict.fromkeys(spec["stat_keys"]) | dict(peak_kv_bytes=kv_bytes)
    return result | dict(stats=stats, warmup_s=warmup_seconds, backend="cpu", vllm_version=vllm.__version__,
                         vllm_settings=settings)  # fmt: skip


def main(argv: Sequence[str]) -> int:
    """``python vllm_worker.py SPEC.json``: the result goes to ``spec['result_path']``."""
    spec = json.loads(Path(argv[0]).read_text())
    start = time.perf_counter()
    result = run_vllm(spec)
    result["worker_s"] = time.perf_counter() - start
    result["records"] = [dataclasses.asdict(r) for r in result["records"]]
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
