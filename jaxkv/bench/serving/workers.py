"""The serving benchmark's workers: each runs one system on one workload in its own process (started
by ``jaxkv.bench.serving.orchestration``; vLLM's is ``jaxkv.bench.vllm_worker``) and returns its
per-request records, statistics and timings."""

from __future__ import annotations

import collections
import dataclasses
import time
from pathlib import Path

import numpy as np

from jaxkv.bench.common import hf_model, hf_sizes, jaxkv_model, jaxkv_sizes, run_as_worker
from jaxkv.bench.serving.metrics import STAT_KEYS, kv_bytes_per_request
from jaxkv.bench.serving.spec import WorkerSpec
from jaxkv.bench.serving.systems import ENGINE_SYSTEMS, base_system
from jaxkv.bench.vllm_worker import (
    Clock, Record, ServingRequest, check_lengths, process_tree_cpu_seconds, startup, timed_drive,
)  # fmt: skip
from jaxkv.serving.sizing import parse_bytes


class CompileCounter:
    """Counts XLA backend compilations in this process (``jax.monitoring`` events)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        import jax

        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == self.EVENT:
            self.count += 1


def worker_engine(spec: WorkerSpec) -> dict:
    """The jaxkv engine: warm-up, then requests added as they arrive and one ``step()`` at a time
    (``vllm_worker.drive``, as for vLLM)."""
    import jax

    compiles = CompileCounter()
    model = jaxkv_model(spec.model, spec.dtype)
    engine = engine_for(spec, model)
    start = time.perf_counter()
    engine.warmup()
    warmup_seconds, warmup_compiles = time.perf_counter() - start, compiles.count
    driven = EngineRequests(engine)
    capped = driven if spec.max_concurrency is None else Capped(driven, spec.max_concurrency)
    result = timed_drive(capped, list(spec.requests), spec.system)
    stats = dict.fromkeys(STAT_KEYS) | engine.stats().as_dict()
    stats.update(
        xla_compiles_warmup=warmup_compiles, xla_compiles_run=compiles.count - warmup_compiles,
        peak_running=max(driven.running, default=0), mean_running=_mean(driven.running),
        kv_bytes_per_request=kv_bytes_per_request(spec.requests, stats, spec.engine.max_pages_per_request),
    )  # fmt: skip
    sizes = jaxkv_sizes(model, spec.dtype)
    return result | dict(stats=stats, warmup_s=warmup_seconds, backend=jax.default_backend(), sizes=sizes)


def _mean(values: list[int]) -> float | None:
    return float(np.mean(values)) if values else None


def engine_for(spec: WorkerSpec, model):
    """The ``jaxkv.serving.Engine`` an engine system serves ``model`` with, built as ``jaxkv serve``
    builds one (``load_engine``): ``spec.engine``, its draft model loaded by name (``model``
    itself when it names the target)."""
    from jaxkv.engine_args import load_engine  # check_args made sure it imports

    def load(name: str, mesh=None):
        return (model if name == spec.model else jaxkv_model(name, spec.dtype)), None

    return load_engine(spec.model, spec.engine, load=load)[0]


class Capped:
    """A driven engine (``vllm_worker.Driven``) with at most ``limit`` requests in flight: a
    request whose arrival has passed waits here for one to finish (its TTFT counts the wait, as a
    client's would), so a run holds a fixed concurrency."""

    def __init__(self, engine, limit: int):
        self.engine, self.limit = engine, limit
        self.held: collections.deque = collections.deque()  # (index, request), in arrival order
        self.in_flight = 0

    def submit(self, index: int, request: ServingRequest) -> None:
        self.held.append((index, request))
        self._admit()

    def step(self) -> list[tuple[int, list[int], bool]]:
        outputs = self.engine.step()
        self.in_flight -= sum(finished for _, _, finished in outputs)
        self._admit()
        return outputs

    def busy(self) -> bool:
        return self.engine.busy() or bool(self.held)

    def _admit(self) -> None:
        while self.held and self.in_flight < self.limit:
            self.engine.submit(*self.held.popleft())
            self.in_flight += 1


class EngineRequests:
    """``jaxkv.serving.Engine`` as ``vllm_worker.drive`` sees it: greedy, end-of-sequence ignored;
    ``running``: how many sequences ran after each step."""

    def __init__(self, engine):
        self.engine = engine
        self.index_of: dict = {}
        self.running: list[int] = []

    def submit(self, index: int, request: ServingRequest) -> None:
        request_id = self.engine.add_request(request.prompt, max_tokens=request.max_tokens, ignore_eos=True)
        self.index_of[request_id] = index

    def step(self) -> list[tuple[int, list[int], bool]]:
        outputs = self.engine.step()
        self.running.append(self.engine.stats().num_running)
        return [(self.index_of[out.request_id], list(out.new_token_ids), out.finished) for out in outputs]

    def busy(self) -> bool:
        return self.engine.has_unfinished()


class StepTimes:
    """``generate``'s ``stream``: the ``time.perf_counter()`` of each step's tokens. One object
    serves every batch: the compiled loop takes it as a static argument, so a new one would
    compile the loop again."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, tokens: np.ndarray) -> None:
        self.times.append(time.perf_counter())


def worker_static(spec: WorkerSpec) -> dict:
    """jaxkv ``generate`` on batches of ``spec.static_batch`` in arrival order."""
    import jax

    compiles = CompileCounter()
    model = jaxkv_model(spec.model, spec.dtype)
    requests, size = list(spec.requests), spec.static_batch
    batches = [requests[i : i + size] for i in range(0, len(requests), size)]
    steps = StepTimes()
    start = time.perf_counter()
    for batch in distinct_shapes(batches):
        generate_static(model, batch, steps)
    warmup_seconds, warmup_compiles = time.perf_counter() - start, compiles.count
    ready = startup()
    records, generations = drive_static(model, batches, steps)
    cpu_seconds = process_tree_cpu_seconds() - ready["startup_cpu_s"]
    check_lengths(records, requests, "static")
    stats = static_stats(batches, generations)
    stats.update(xla_compiles_warmup=warmup_compiles, xla_compiles_run=compiles.count - warmup_compiles)
    backend, sizes = jax.default_backend(), jaxkv_sizes(model, spec.dtype)
    return dict(records=records, stats=stats, warmup_s=warmup_seconds, backend=backend, cpu_s=cpu_seconds, sizes=sizes,
                **ready)  # fmt: skip


def batch_shape(batch: list[ServingRequest]) -> tuple[int, int, int]:
    """What ``generate`` compiles for: rows, padded prompt width, new tokens."""
    from jaxkv.sizing import bucket

    return len(batch), bucket(max(len(r.prompt) for r in batch)), max(r.max_tokens for r in batch)


def distinct_shapes(batches: list[list[ServingRequest]]) -> list[list[ServingRequest]]:
    """The first batch of each shape: running those compiles everything the timed run needs."""
    first: dict[tuple[int, int, int], list[ServingRequest]] = {}
    for batch in batches:
        first.setdefault(batch_shape(batch), batch)
    return list(first.values())


def generate_static(model, batch: list[ServingRequest], steps: StepTimes):
    """One greedy ``generate`` call to the batch's longest output, no stop token; ``steps`` restarts."""
    from jaxkv.decoding.generate import generate

    steps.times.clear()
    return generate(
        model, [r.prompt for r in batch], max_new_tokens=max(r.max_tokens for r in batch), stop_tokens=(),
        stream=steps,
    )  # fmt: skip


def drive_static(model, batches: list[list[ServingRequest]], steps: StepTimes) -> tuple[list[Record], list]:
    """Each batch once its last request has arrived (and the previous batch is done); a row's
    first token and finish are the times of its first and its last wanted step."""
    clock = Clock()
    records, generations = [], []
    for batch in batches:
        clock.sleep_until(max(r.arrival for r in batch))
        generations.append(generate_static(model, batch, steps))
        times = [clock.since_start(t) for t in steps.times]
        records += [Record(r.arrival, times[0], times[r.max_tokens - 1], r.max_tokens) for r in batch]
    return records, generations


def static_stats(batches: list[list[ServingRequest]], generations: list) -> dict:
    """Peak K/V bytes (the largest batch's cache) and the share of allocated slots (rows x
    capacity) not holding a request's own prompt and output tokens."""
    used = sum(len(r.prompt) + r.max_tokens for batch in batches for r in batch)
    allocated = sum(g.tokens.shape[0] * g.cache.max_length for g in generations)
    return dict.fromkeys(STAT_KEYS) | dict(
        peak_kv_bytes=max(g.cache_bytes for g in generations), wasted_slot_fraction=1 - used / allocated,
        num_compiled=len(distinct_shapes(batches)),
    )  # fmt: skip


def worker_hf(spec: WorkerSpec) -> dict:
    """transformers' continuous batching: requests added as they arrive, tokens timed by transformers."""
    import torch

    torch.set_num_threads(spec.threads)
    model = hf_model(spec.model, spec.dtype)
    requests = list(spec.requests)
    kv_bytes_per_token = hf_sizes(model)["kv_bytes_per_token"]
    engine = spec.engine
    num_blocks = parse_bytes(engine.kv_memory) // (engine.page_size * kv_bytes_per_token)
    start = time.perf_counter()
    with torch.inference_mode():  # the manager's thread runs in the mode it was started in
        manager = start_hf_manager(model, spec, num_blocks)
        try:
            warm_up_hf(manager, requests[0].prompt[: engine.page_size - 1])  # less than a page: nothing to share
            warmup_seconds = time.perf_counter() - start
            ready = startup()
            records = drive_hf(manager, requests)
            cpu_seconds = process_tree_cpu_seconds() - ready["startup_cpu_s"]
        finally:
            manager.stop(block=True)
    check_lengths(records, requests, "hf")
    stats = dict.fromkeys(STAT_KEYS) | dict(peak_kv_bytes=num_blocks * engine.page_size * kv_bytes_per_token)
    return dict(records=records, stats=stats, warmup_s=warmup_seconds, backend="cpu", num_blocks=num_blocks,
                attn_implementation=model.config._attn_implementation, threads=torch.get_num_threads(),
                cpu_s=cpu_seconds, **ready)  # fmt: skip


def start_hf_manager(model, spec: WorkerSpec, num_blocks: int):
    """A started continuous-batching manager: greedy, the engine's page size and batch limits,
    ``num_blocks`` pages of K/V (on the CPU it would otherwise size its pool from 60% of RAM)."""
    import transformers

    generation = transformers.GenerationConfig(do_sample=False, max_new_tokens=spec.max_output)
    batching = transformers.ContinuousBatchingConfig(
        page_size=spec.engine.page_size, num_blocks=num_blocks, max_batch_tokens=spec.engine.max_num_batched_tokens,
        max_requests_per_batch=spec.engine.max_num_seqs,
    )  # fmt: skip
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    manager.warmup()
    manager.start()
    return manager


def warm_up_hf(manager, prompt: list[int]) -> None:
    """One 2-token request through the manager: first-call allocations happen before the timer."""
    request_id = manager.add_request(prompt, request_id="warm-up", max_new_tokens=2, eos_token_id=-1)
    if request_id is None:
        raise RuntimeError("transformers' continuous batching manager refused the warm-up request")
    collect_hf(manager, 1)


def drive_hf(manager, requests: list[ServingRequest]) -> list[Record]:
    """Each request added at its arrival time (the manager's thread generates meanwhile);
    eos_token_id=-1 turns end-of-sequence off."""
    clock = Clock()
    for i, request in enumerate(requests):
        clock.sleep_until(request.arrival)
        manager.add_request(request.prompt, request_id=str(i), max_new_tokens=request.max_tokens,
                            record_timestamps=True, eos_token_id=-1)  # fmt: skip
    results = collect_hf(manager, len(requests))
    return [hf_record(results[str(i)], request, clock) for i, request in enumerate(requests)]


def collect_hf(manager, count: int) -> dict:
    """The next ``count`` finished results by request id; raises if one failed or the manager died."""
    results = {}
    while len(results) < count:
        result = manager.get_result(timeout=1)
        if result is None and not manager.is_running():
            raise RuntimeError("transformers' continuous batching thread stopped before every request finished")
        if result is not None and result.error is not None:
            raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
        if result is not None and result.is_finished():
            results[result.request_id] = result
    return results


def hf_record(result, request: ServingRequest, clock: Clock) -> Record:
    times = result.timestamps
    return Record(request.arrival, clock.since_start(times[0]), clock.since_start(times[-1]),
                  len(result.generated_tokens))  # fmt: skip


WORKERS = {**dict.fromkeys(ENGINE_SYSTEMS, worker_engine), "static": worker_static, "hf": worker_hf}


def worker_main(spec_path: Path) -> int:
    """``python -m jaxkv.bench.serving --worker SPEC``: the spec's system on its workload."""
    return run_as_worker(spec_path, _run_system)


def _run_system(data: dict) -> dict:
    spec = WorkerSpec.model_validate(data)
    result = WORKERS[base_system(spec.system)](spec)
    return result | dict(records=[dataclasses.asdict(r) for r in result["records"]])
