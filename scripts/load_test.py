#!/usr/bin/env python
"""Load test of ``jaxkv serve``: concurrent streaming clients (the official ``openai`` client)
against a server on this machine, then the same requests through ``jaxkv.serving.Engine`` in
this process, to price the HTTP layer.

    python scripts/load_test.py                                     # starts its own server, 64 requests
    python scripts/load_test.py --url http://127.0.0.1:8000         # a running server (same engine options!)
    python scripts/load_test.py --quick --out /tmp/load.json        # smoke run
    python scripts/load_test.py --server jaxkv vllm                 # jaxkv serve and vLLM's server, one after the other

Loopback only: the server is started on 127.0.0.1 (a free port), and ``--url`` must name
127.0.0.1, localhost or ::1. Bounded in count and time: ``--requests`` requests, each with
``--request-timeout``; each run stops at ``--timeout`` and reports what finished.

Workload (seeded): the serving benchmark's ``random`` workload (``jaxkv.bench.serving``):
``--requests`` prompts of ``--min-prompt``..``--max-prompt`` tokens (log-uniform) cut from the
Lee corpus, sent as token ids, each asking for ``--max-tokens`` tokens greedily
(``temperature=0``). The server cannot ignore end-of-sequence, so a request may stop early;
output tokens are counted from the usage chunk (``stream_options.include_usage``).

Runs, each with at most ``--concurrency`` requests in flight (a new one starts when one ends):

* HTTP: ``--concurrency`` asyncio clients streaming ``/v1/completions`` through
  ``openai.AsyncOpenAI``; a request's first token is its first chunk with a choice, its
  inter-token latencies (ITL) the gaps between such chunks (a chunk may carry more than one
  token when text is held back), its finish the end of the stream.
* ``--server vllm`` / ``vllm-matched`` (HTTP, the same clients): vLLM's OpenAI server
  (``python -m vllm.entrypoints.openai.api_server`` from the venv ``jaxkv.bench.vllm_env``
  makes on first use; skipped with the reason when it cannot be made) on 127.0.0.1 and a free
  port, float32, with the same K/V memory; ``vllm`` keeps vLLM's own batching settings,
  ``vllm-matched`` takes the engine options (its block size rounded up to a multiple of 32).
  With a vLLM server, every run loads the float32 checkpoint folder that vLLM loads, so all
  run the same weights.
* in-process: ``Engine`` with the same options (``--kv-memory``, ``--page-size``,
  ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--max-model-len``), warmed up, stepped
  by this process; a token's time is the end of the step that produced it.

Both start with one short request that is not timed. Metrics over the completed requests:
requests/s and output tokens/s over the makespan (run start to last finish), TTFT (first
token - start of the request) and ITL p50/p99, errors (the goal is 0). HTTP overhead =
1 - HTTP output tok/s / in-process output tok/s (target under 10%).

Outputs: a markdown table on stdout and ``--out`` (JSON, per-request traces included). Exit
status 1 when a request failed or did not finish, or the server did not exit 0 on SIGTERM; the
overhead target is reported, not enforced (timings are only meaningful on a quiet machine).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import ipaddress
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import httpx
import openai
import psutil

from jaxkv.bench.common import cpu_cores, fmt, worker_env
from jaxkv.bench.serving import (
    Clock, ServingRequest, WorkloadShape, make_workload, percentile, token_source, workload_summary,
)  # fmt: skip
from jaxkv.bench.vllm_env import VENV, VllmUnavailable, engine_args, ensure_checkpoint, ensure_venv, server_flags
from jaxkv.engine_args import add_engine_flags, engine_argv, engine_config, load_engine
from jaxkv.serving.sizing import parse_bytes

LOOPBACK_NAMES = ("localhost",)  # and every loopback address (127.0.0.0/8, ::1)
TARGET_OVERHEAD = 0.10
HTTP, ENGINE = "http", "engine"
VLLM_SERVERS = ("vllm", "vllm-matched")
SERVERS = ("jaxkv", *VLLM_SERVERS)
SYSTEMS = {
    HTTP: "jaxkv serve (HTTP, openai client)", "vllm": "vLLM serve, its defaults (HTTP, openai client)",
    "vllm-matched": "vLLM serve, jaxkv's settings (HTTP, openai client)", ENGINE: "jaxkv engine (in-process)",
}  # fmt: skip
WARM_UP_TOKENS = 2
SERVER_STOP_TIMEOUT = 120  # seconds the server may take to drain and exit after SIGTERM
LOG_TAIL = 3000  # characters of the server's log shown when it fails
METRICS = ("makespan_s", "output_tokens", "output_tok_s", "requests_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms",
           "itl_p99_ms")  # fmt: skip
# --quick: a smoke run's defaults (flags given explicitly still win).
QUICK = dict(
    requests=8, concurrency=4, max_tokens=8, min_prompt=8, max_prompt=64, kv_memory="128MiB", max_num_seqs=4,
    max_num_batched_tokens=64, max_model_len=256, timeout=300, request_timeout=120,
)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# per-request traces and metrics


@dataclasses.dataclass
class Trace:
    """One request as its client saw it, in seconds since the run start."""

    start: float
    first_token: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)  # arrivals of chunks (HTTP) or steps
    finish: float | None = None
    output_tokens: int = 0
    error: str | None = None

    def tokens_arrived(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        self.token_times.append(now)

    @property
    def completed(self) -> bool:
        return self.finish is not None and self.error is None


def summarize(traces: Sequence[Trace], planned: int) -> dict:
    """Counts, throughput over the makespan and latency percentiles of the completed requests."""
    done = [t for t in traces if t.completed]
    errors = [t.error for t in traces if t.error is not None]
    counts = dict(planned=planned, started=len(traces), completed=len(done), errors=len(errors),
                  error_messages=sorted(set(errors))[:10])  # fmt: skip
    if not done:
        return counts | dict.fromkeys(METRICS)
    makespan = max(t.finish for t in done)
    output_tokens = sum(t.output_tokens for t in done)
    ttft = [t.first_token - t.start for t in done]
    itl_ms = [1000 * (later - earlier) for t in done for earlier, later in zip(t.token_times, t.token_times[1:])]
    return counts | dict(
        makespan_s=makespan, output_tokens=output_tokens, output_tok_s=output_tokens / makespan,
        requests_s=len(done) / makespan, ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        itl_p50_ms=percentile(itl_ms, 50), itl_p99_ms=percentile(itl_ms, 99),
    )  # fmt: skip


def not_finished(traces: Sequence[Trace], why: str) -> None:
    """Mark the requests still in flight when a run stopped."""
    for trace in traces:
        if trace.finish is None and trace.error is None:
            trace.error = why


# ----------------------------------------------------------------------------------------------
# the server


def is_loopback(host: str) -> bool:
    try:
        return host in LOOPBACK_NAMES or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    """``jaxkv serve`` on 127.0.0.1 with this run's engine settings (``args.engine``)."""
    return [
        sys.executable, "-m", "jaxkv.cli", "serve", "--model", args.model, "--host", "127.0.0.1", "--port",
        str(port), "--max-waiting", str(args.max_waiting), *engine_argv(args.engine),
    ]  # fmt: skip


def vllm_serve_command(args: argparse.Namespace, port: int, server: str) -> list[str]:
    """vLLM's OpenAI server from its venv, on the float32 checkpoint, with ``engine_args``' settings."""
    engine = args.engine
    settings = engine_args(server, args.model, kv_memory_bytes=parse_bytes(engine.kv_memory),
                           page_size=engine.page_size, max_num_seqs=engine.max_num_seqs,
                           max_num_batched_tokens=engine.max_num_batched_tokens)  # fmt: skip
    if engine.max_model_len is not None:
        settings["max_model_len"] = engine.max_model_len
    return [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port",
            str(port), *server_flags(settings)]  # fmt: skip


def log_tail(log: IO[str]) -> str:
    log.seek(0)
    return log.read()[-LOG_TAIL:]


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, log: IO[str]) -> None:
    """Poll ``/health`` until it answers 200; raise with the server's log if it exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready:\n{log_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:  # not listening yet
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready in {timeout:g} s (--startup-timeout):\n{log_tail(log)}")


def stop_server(proc: subprocess.Popen, log: IO[str]) -> int:
    """SIGTERM (the server drains, then exits 0); killed if it has not exited in SERVER_STOP_TIMEOUT s.
    Its descendants still alive afterwards (vLLM's engine core) are killed too."""
    descendants = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        status = proc.wait(timeout=SERVER_STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        status = proc.wait()
        print(f"[load] the server did not exit {SERVER_STOP_TIMEOUT} s after SIGTERM; killed", file=sys.stderr)
    _, alive = psutil.wait_procs(descendants, timeout=5)
    for child in alive:
        child.kill()
    if status != 0:
        print(f"[load] the server exited with {status}:\n{log_tail(log)}", file=sys.stderr)
    return status


@contextlib.contextmanager
def local_server(args: argparse.Namespace, server: str, report: dict) -> Iterator[str]:
    """``jaxkv serve`` (or vLLM's server) on 127.0.0.1 and a free port with the engine options;
    yields its URL once ``/health`` answers; stops it on exit. Its start-up seconds and exit status
    go in ``report``: ``server_startup_s``/``server_exit`` for jaxkv, ``vllm_servers[server]`` for vLLM."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = serve_command(args, port) if server == "jaxkv" else vllm_serve_command(args, port, server)
    print(f"[load] starting {server} on {url} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=worker_env())
        entry = report if server == "jaxkv" else report.setdefault("vllm_servers", {}).setdefault(server, {})
        try:
            wait_ready(proc, url, args.startup_timeout, log)
            entry["server_startup_s"] = time.perf_counter() - start
            print(f"[load] ready in {entry['server_startup_s']:.1f} s", file=sys.stderr, flush=True)
            yield url
        finally:
            entry["server_exit"] = stop_server(proc, log)


# ----------------------------------------------------------------------------------------------
# the HTTP run


async def stream_one(client, model: str, request: ServingRequest, trace: Trace, clock: Clock) -> None:
    """One streaming completion; fills ``trace``. A stream without usage or that ends
    other than by a stop or the length limit is an error."""
    stream = await client.completions.create(
        model=model, prompt=request.prompt, max_tokens=request.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usage, finish_reason = None, None
    async for chunk in stream:
        now = clock.now()
        if chunk.choices:
            trace.tokens_arrived(now)
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        usage = chunk.usage or usage
    trace.finish = clock.now()
    if usage is None:
        trace.error = "the stream ended without a usage chunk (stream_options.include_usage)"
    elif finish_reason not in ("stop", "length"):
        trace.error = f"the stream ended with finish_reason {finish_reason!r}"
    else:
        trace.output_tokens = usage.completion_tokens


async def http_clients(url: str, requests: list[ServingRequest], args: argparse.Namespace) -> list[Trace]:
    """``--concurrency`` clients taking requests from one queue until it is empty or ``--timeout`` passes."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=args.request_timeout)
    model = (await client.models.list()).data[0].id
    await stream_one(client, model, warm_up_request(requests[0]), Trace(0.0), Clock())
    queue, traces, clock = collections.deque(requests), [], Clock()

    async def client_loop() -> None:
        while queue:
            request, trace = queue.popleft(), Trace(clock.now())
            traces.append(trace)
            try:
                await asyncio.wait_for(stream_one(client, model, request, trace, clock), args.request_timeout)
            except TimeoutError:
                trace.error = f"timed out after {args.request_timeout:g} s (--request-timeout)"
            except openai.APIError as error:
                trace.error = f"{type(error).__name__}: {error}"

    tasks = [asyncio.create_task(client_loop()) for _ in range(args.concurrency)]
    _, late = await asyncio.wait(tasks, timeout=args.timeout)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    await client.close()
    not_finished(traces, f"unfinished at the {args.timeout:g} s --timeout")
    return traces


def warm_up_request(request: ServingRequest) -> ServingRequest:
    """A short request ahead of the timed run (first-call costs on either side)."""
    return dataclasses.replace(request, max_tokens=WARM_UP_TOKENS)


def run_http(url: str, requests: list[ServingRequest], args: argparse.Namespace) -> list[Trace]:
    print(f"[load] HTTP: {len(requests)} requests, {args.concurrency} at a time ...", file=sys.stderr, flush=True)
    return asyncio.run(http_clients(url, requests, args))


# ----------------------------------------------------------------------------------------------
# the in-process run


def build_engine(args: argparse.Namespace):
    """The engine ``jaxkv serve`` builds for these settings (``load_engine``), warmed up (every
    step shape compiled)."""
    engine, _ = load_engine(args.model, args.engine)
    engine.warmup()
    return engine


def drive_engine(engine, requests: list[ServingRequest], concurrency: int, timeout: float) -> list[Trace]:
    """At most ``concurrency`` requests in the engine, a new one added when one finishes; stops
    (aborting what runs) at ``timeout`` seconds."""
    queue, traces, running, clock = collections.deque(requests), [], {}, Clock()
    while (queue or running) and clock.now() < timeout:
        while queue and len(running) < concurrency:
            request, trace = queue.popleft(), Trace(clock.now())
            traces.append(trace)
            running[engine.add_request(request.prompt, max_tokens=request.max_tokens)] = trace
        outputs = engine.step()
        now = clock.now()
        for output in outputs:
            trace = running[output.request_id]
            if output.new_token_ids:
                trace.tokens_arrived(now)
                trace.output_tokens += len(output.new_token_ids)
            if output.finished:
                trace.finish = now
                del running[output.request_id]
                engine.pop(output.request_id)  # forgotten, as the server's runner does
    for request_id in running:
        engine.abort(request_id)
    not_finished(traces, f"unfinished at the {timeout:g} s --timeout")
    return traces


def run_engine(requests: list[ServingRequest], args: argparse.Namespace) -> list[Trace]:
    print("[load] in-process engine: loading and compiling ...", file=sys.stderr, flush=True)
    engine = build_engine(args)
    drive_engine(engine, [warm_up_request(requests[0])], 1, args.timeout)
    print(f"[load] in-process engine: {len(requests)} requests, {args.concurrency} at a time ...", file=sys.stderr,
          flush=True)  # fmt: skip
    return drive_engine(engine, requests, args.concurrency, args.timeout)


# ----------------------------------------------------------------------------------------------
# report


TABLE_HEADER = ("system", "requests", "errors", "req/s", "output tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms",
                "ITL p99 ms")  # fmt: skip


def table_cells(row: dict) -> list[str]:
    return [
        SYSTEMS[row["system"]], f"{row['completed']}/{row['planned']}", str(row["errors"]),
        fmt(row["requests_s"], ".2f"), fmt(row["output_tok_s"], ".1f"), fmt(row["ttft_p50_s"], ".2f"),
        fmt(row["ttft_p99_s"], ".2f"), fmt(row["itl_p50_ms"], ".1f"), fmt(row["itl_p99_ms"], ".1f"),
    ]  # fmt: skip


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |", "|---|" + "---:|" * (len(TABLE_HEADER) - 1)]
    return "\n".join(lines + ["| " + " | ".join(table_cells(row)) + " |" for row in rows])


def overhead(http: dict, engine: dict) -> dict:
    """1 - HTTP output tok/s / in-process output tok/s, against the 10% target (None: not measured)."""
    if http["output_tok_s"] is None or engine["output_tok_s"] is None:
        return dict(value=None, passed=None, display="not measured")
    value = 1 - http["output_tok_s"] / engine["output_tok_s"]
    return dict(value=value, passed=value < TARGET_OVERHEAD, display=f"{value:.1%}")


def machine() -> dict:
    return dict(cores=cpu_cores(), load_average=os.getloadavg())


def print_report(title: str, table: str, cost: dict, report: dict) -> None:
    print(f"## Load test: {title}\n")
    print(table)
    mark = {True: "PASS", False: "FAIL", None: "n/a"}[cost["passed"]]
    print(f"\nHTTP overhead (1 - HTTP / in-process output tok/s): {cost['display']} "
          f"[{mark}: target under {TARGET_OVERHEAD:.0%}]")  # fmt: skip
    load = ", ".join(f"{name} {report[name]['load_average'][0]:.2f}" for name in ("machine_before", "machine_after"))
    print(f"\n{report['machine_before']['cores']} cores; 1-minute load average: {load}")
    if "server_exit" in report:
        print(f"server exit status after SIGTERM: {report['server_exit']}")
    for server, entry in report.get("vllm_servers", {}).items():
        print(f"{server} server exit status after SIGTERM: {entry.get('server_exit')}")
    if "skipped" in report:
        print(report["skipped"])


def succeeded(rows: list[dict], report: dict) -> bool:
    """Every request completed, and jaxkv serve exited 0 (vLLM's exit status is reported, not judged)."""
    return all(row["errors"] == 0 and row["completed"] == row["planned"] for row in rows) and (
        report.get("server_exit", 0) == 0
    )


# ----------------------------------------------------------------------------------------------
# main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--url", help="a running jaxkv server (loopback only); default: start one on a free port")
    parser.add_argument("--server", nargs="+", choices=SERVERS, default=["jaxkv"],
                        help="servers started here, one after the other (vllm: vLLM's defaults; vllm-matched: "
                        "the engine options)")  # fmt: skip
    parser.add_argument("--vllm-venv", type=Path, default=VENV, help="vLLM's venv (made on first use)")
    parser.set_defaults(vllm_python=None)  # its python, once prepare_vllm has made the venv
    parser.add_argument("--model", default="smollm2", help="the served model (its tokenizer cuts the prompts)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (both runs)")
    parser.add_argument("--max-tokens", type=int, default=128, help="per request; end-of-sequence may stop it sooner")
    parser.add_argument("--min-prompt", type=int, default=16)
    parser.add_argument("--max-prompt", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--max-waiting", type=int, default=64, help="the started server's --max-waiting")
    add_engine_flags(parser, skip=("seed",))  # the server's and the in-process engine's settings
    parser.set_defaults(kv_memory="512MiB")
    parser.add_argument("--timeout", type=float, default=600, help="seconds each run (HTTP, in-process) may take")
    parser.add_argument("--request-timeout", type=float, default=300, help="seconds one request may take")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds the started server may take")
    parser.add_argument("--quick", action="store_true", help=f"smoke-run defaults: {QUICK}")
    parser.add_argument("--out", type=Path, default=Path("results/load_test.json"), help="JSON report")
    if parser.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.engine = engine_config(args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.requests, args.concurrency, args.max_tokens, args.min_prompt) < 1:
        parser.error("--requests, --concurrency, --max-tokens and --min-prompt must be positive")
    if args.min_prompt > args.max_prompt:
        parser.error("--min-prompt must not exceed --max-prompt")
    if min(args.timeout, args.request_timeout, args.startup_timeout) <= 0:
        parser.error("--timeout, --request-timeout and --startup-timeout must be positive")
    if args.url is not None and args.server != ["jaxkv"]:
        parser.error("--url names a running jaxkv server; --server starts servers here: give one or the other")
    if args.url is not None and not is_loopback(urllib.parse.urlsplit(args.url).hostname or ""):
        parser.error(f"--url {args.url}: the load test runs on loopback only; give http://127.0.0.1:PORT "
                     "(or localhost, [::1]), or leave --url out to start a server here")  # fmt: skip


def build_requests(args: argparse.Namespace) -> list[ServingRequest]:
    """The serving benchmark's seeded ``random`` workload, all at once, every output ``--max-tokens``."""
    shape = WorkloadShape(num_requests=args.requests, rate=math.inf, min_prompt=args.min_prompt,
                          max_prompt=args.max_prompt, min_output=args.max_tokens, max_output=args.max_tokens,
                          system_prompts=1, system_prompt_tokens=args.min_prompt)  # fmt: skip
    return make_workload("random", token_source(args.model), shape, args.seed)


def http_traces(args: argparse.Namespace, server: str, requests: list[ServingRequest], report: dict) -> list[Trace]:
    """The HTTP run against ``--url``, or against a server started (and stopped) here."""
    if args.url is not None:
        return run_http(args.url.rstrip("/"), requests, args)
    with local_server(args, server, report) as url:
        return run_http(url, requests, args)


def prepare_vllm(args: argparse.Namespace, report: dict) -> None:
    """With a vLLM server asked for: ``args.vllm_python`` (its venv, made on first use) and
    ``args.model`` the float32 checkpoint folder every run loads; when the venv cannot be made,
    the vLLM servers leave ``args.server`` and the reason goes in ``report['skipped']``."""
    wanted = [s for s in args.server if s in VLLM_SERVERS]
    if not wanted:
        return
    try:
        args.vllm_python = ensure_venv(args.vllm_venv)
    except VllmUnavailable as error:
        report["skipped"] = f"vLLM is unavailable, so {', '.join(wanted)} are skipped: {error}"
        print(f"[load] {report['skipped']}", file=sys.stderr, flush=True)
        args.server = [s for s in args.server if s not in VLLM_SERVERS]
        return
    args.model = str(ensure_checkpoint(args.model))


def make_row(system: str, traces: list[Trace], planned: int) -> dict:
    return dict(system=system, **summarize(traces, planned), traces=[dataclasses.asdict(t) for t in traces])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    requests = build_requests(args)
    report: dict = dict(machine_before=machine())
    prepare_vllm(args, report)
    rows = [make_row(HTTP if server == "jaxkv" else server, http_traces(args, server, requests, report), len(requests))
            for server in args.server]  # fmt: skip
    rows.append(make_row(ENGINE, run_engine(requests, args), len(requests)))
    report["machine_after"] = machine()
    http = next((row for row in rows if row["system"] == HTTP), None)
    cost = overhead(http, rows[-1]) if http is not None else dict(value=None, passed=None, display="not measured")
    table = markdown_table(rows)
    title = (f"{args.model}, {args.requests} requests, concurrency {args.concurrency}, prompts "
             f"{args.min_prompt}-{args.max_prompt} tokens, max_tokens {args.max_tokens}, seed {args.seed}")  # fmt: skip
    print_report(title, table, cost, report)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}  # vllm_python too
    settings["engine"] = dataclasses.asdict(args.engine)
    report.update(settings=settings, workload=workload_summary(requests), rows=rows, overhead=cost,
                  table_markdown=table, total_seconds=time.perf_counter() - start)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return 0 if succeeded(rows, report) else 1


if __name__ == "__main__":
    sys.exit(main())
