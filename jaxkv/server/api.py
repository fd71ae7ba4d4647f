"""``jaxkv serve``: an OpenAI-compatible HTTP server over the serving engine.

    jaxkv serve --model smollm2 --host 127.0.0.1 --port 8000 --kv-memory 1GiB

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat
template), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). The engine
steps in its own thread (``EngineThread``); each request's outputs reach its handler through
an asyncio queue. The bodies are ``jaxkv.server.schemas``; every error is OpenAI's shape with
a 4xx naming the field (``jaxkv.server.errors``), a body not sent as ``application/json`` a
415; past ``max_waiting`` queued requests the server answers 503 with ``Retry-After``; a client
that disconnects aborts its request (one INFO line on the ``jaxkv.server`` logger); a request
that fails in the engine answers 500 (or an error event in its stream) and leaves
the others running; ``/health`` answers 503 once the engine thread has stopped. With the
engine's speculative decoding, a body's ``speculative: false`` opts the request out, and a
response (a streamed one: each chunk with usage) carries the request's draft counters under
``speculation``, beside an unchanged ``usage``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxkv.server.errors import APIError, ClientDisconnected, error_body, install_handlers, read_json, validated
from jaxkv.server.schemas import ChatRequest, CompletionRequest
from jaxkv.serving.engine_thread import EngineThread, EngineUnavailable
from jaxkv.serving.requests import RequestError, RequestOutput
from jaxkv.serving.speculation import SpeculationStats
from jaxkv.serving.stats import EngineStats

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context limit
ENDED = ("abort", "error")  # finish reasons that end a whole request (every sequence of it)
DISCONNECT_POLL_S = 0.5  # how often a request in flight checks that its client is still connected
log = logging.getLogger("jaxkv.server")


# --- metrics ---------------------------------------------------------------------------------
class Metrics:
    """The server's Prometheus metrics (its own registry, so several servers can live in one process)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("jaxkv_requests", "requests by outcome", ["outcome"], registry=self.registry)
        self.ttft = Histogram("jaxkv_time_to_first_token_seconds", "time to first token", registry=self.registry)
        self.tpot = Histogram("jaxkv_time_per_output_token_seconds", "time per output token", registry=self.registry)
        # Speculative decoding: counters of the engine's totals (``EngineStats.speculation``), by name.
        self.speculation = self._named(Counter, "jaxkv_speculative_", {
            "proposed_tokens": "draft tokens verified",
            "accepted_tokens": "draft tokens the target model kept",
            "steps": "request-steps that verified drafts",
        })  # fmt: skip
        self.counted = dict.fromkeys(self.speculation, 0)  # the totals the counters have reached
        self.gauges = self._named(Gauge, "jaxkv_", {
            "running_requests": "sequences holding a row",
            "waiting_requests": "sequences waiting for a row or pages",
            "pages_used": "pages in use over all pools",
            "pages_free": "free pages over all pools (cached ones included)",
            "prefix_cache_hit_rate": "prompt tokens served from the prefix cache",
            "preemptions": "sequences preempted since start",
            "swaps": "preempted sequences whose pages went to the host tier",
            "recomputes": "preempted sequences whose pages were freed, to be computed again",
            "device_prefix_hit_pages": "prefix-cache pages found in the device pools since start",
            "host_prefix_hit_pages": "prefix-cache pages found in the host tier since start",
            "host_pages": "pages held in the host tier",
            "host_bytes_in": "bytes copied from the device pools to the host tier since start",
            "host_bytes_out": "bytes copied from the host tier to the device pools since start",
            "disk_prefix_hit_pages": "prefix-cache pages read from the disk tier since start",
            "disk_pages": "pages on disk in the disk tier (every engine's on its directory)",
            "disk_bytes_written": "bytes of page files written to the disk tier since start",
            "disk_bytes_read": "bytes of page files read from the disk tier since start",
            "speculative_acceptance_rate": "accepted / proposed draft tokens since start",
            "speculative_mean_accepted_length": "tokens a request-step that verified drafts made (1 + accepted)",
        })  # fmt: skip

    def _named(self, kind, prefix: str, helps: dict[str, str]) -> dict:
        """A ``kind`` metric (Counter, Gauge) per name of ``helps`` (its help text), named ``prefix + name``."""
        return {name: kind(prefix + name, help_text, registry=self.registry) for name, help_text in helps.items()}

    def render(self, stats: EngineStats) -> bytes:
        """The metrics in Prometheus' text format, the gauges set and the counters advanced to ``stats``."""
        pools, host, disk, speculation = stats.pages.values(), stats.host, stats.disk, stats.speculation
        values = {
            "running_requests": stats.num_running,
            "waiting_requests": stats.num_waiting,
            "pages_used": sum(pool.used for pool in pools),
            "pages_free": sum(pool.free for pool in pools),
            "prefix_cache_hit_rate": stats.prefix_cache.hit_rate,
            "preemptions": stats.preemptions,
            "swaps": stats.swaps,
            "recomputes": stats.recomputes,
            "device_prefix_hit_pages": stats.device.hit_pages,
            "host_prefix_hit_pages": host.hit_pages,
            "host_pages": host.pages,
            "host_bytes_in": host.bytes_written,
            "host_bytes_out": host.bytes_read,
            "disk_prefix_hit_pages": disk.hit_pages,
            "disk_pages": disk.pages,
            "disk_bytes_written": disk.bytes_written,
            "disk_bytes_read": disk.bytes_read,
            "speculative_acceptance_rate": speculation.acceptance_rate,
            "speculative_mean_accepted_length": speculation.mean_accepted_length,
        }
        for name, value in values.items():
            self.gauges[name].set(value)
        totals = {"proposed_tokens": speculation.proposed, "accepted_tokens": speculation.accepted,
                  "steps": speculation.steps}  # fmt: skip
        for name, total in totals.items():
            self.speculation[name].inc(total - self.counted[name])
            self.counted[name] = total
        return generate_latest(self.registry)


# --- one request's stream of outputs -----------------------------------------------------------
class ChoiceStream:
    """What the server has sent of one choice (one sequence of the request): its text, tokens
    and logprobs so far. The engine decides what text is safe to send (``RequestOutput.delta``)."""

    def __init__(self):
        self.sent_text, self.tokens, self.logprobs = "", [], []
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens the prefix cache served
        self.speculation = SpeculationStats()  # its drafts: proposed, accepted, verifying steps

    def take(self, output: RequestOutput) -> str:
        """Record ``output``; returns its new text."""
        self.tokens += output.new_token_ids
        self.logprobs += list(output.logprobs)
        self.cached_tokens = output.num_cached_tokens
        self.speculation = SpeculationStats(output.num_proposed, output.num_accepted, output.num_speculative_steps)
        self.sent_text += output.delta
        if output.finished:
            self.finish_reason = output.finish_reason
        return output.delta


class Server:
    """The engine thread, the tokenizer and the model's name behind the HTTP endpoints."""

    def __init__(self, runner: EngineThread, tokenizer, model_name: str):
        self.runner, self.tokenizer, self.model_name = runner, tokenizer, model_name
        self.max_model_len = runner.engine.max_model_len
        self.metrics = Metrics()

    # --- admission ---------------------------------------------------------------------------
    def prompt_ids(self, body: CompletionRequest | ChatRequest) -> list[int]:
        if body.model != self.model_name:
            raise APIError(
                404,
                f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "not_found_error",
            )
        if isinstance(body, ChatRequest):
            try:
                text = self.tokenizer.apply_chat_template(body.chat())
            except Exception as error:  # a template without a chat format, or one that refuses the roles
                raise APIError(400, f"the model's chat template cannot format these messages: {error}", "messages")
            prompt = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt = self.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        if len(prompt) >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt is {len(prompt)} tokens; the context holds {self.max_model_len} (prompt plus output)",
                body.api_field("prompt_ids"),
            )
        return prompt

    def submit(self, body: CompletionRequest | ChatRequest, queue: asyncio.Queue, loop) -> tuple[int, int]:
        """Queue the request on the engine; returns its id and prompt length. Errors name the field."""
        prompt = self.prompt_ids(body)
        default = self.max_model_len - len(prompt) if isinstance(body, ChatRequest) else COMPLETION_MAX_TOKENS
        options = body.request_options(default)
        try:
            request_id = self.runner.submit(prompt, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out), options)
        except RequestError as error:
            raise APIError(400, str(error), body.api_field(error.param)) from None
        except EngineUnavailable as error:
            raise APIError(503, str(error), None, "server_busy") from None
        return request_id, len(prompt)

    async def outputs(self, request: Request, request_id: int, queue: asyncio.Queue, n: int) -> AsyncIterator:
        """The request's outputs until all ``n`` sequences finished. Every ``DISCONNECT_POLL_S``,
        whether outputs arrive or not, it checks that the client is still connected, and raises
        ``ClientDisconnected`` if not (a stream's client leaving cancels the task instead). Either
        way the request is aborted, counted as ``disconnected`` and logged as one INFO line: a
        client leaving is ordinary, not a fault to log with a traceback."""
        finished, check_at = 0, time.monotonic()
        try:
            while finished < n:
                if time.monotonic() >= check_at:
                    if await request.is_disconnected():
                        raise ClientDisconnected(request_id)
                    check_at = time.monotonic() + DISCONNECT_POLL_S
                try:
                    output = await asyncio.wait_for(queue.get(), timeout=DISCONNECT_POLL_S)
                except TimeoutError:
                    continue
                finished = n if output.finish_reason in ENDED else finished + output.finished
                yield output
        except (ClientDisconnected, asyncio.CancelledError, GeneratorExit):
            self.runner.abort(request_id)
            self.metrics.requests.labels("disconnected").inc()
            log.info("request %d: the client disconnected before its answer; aborted", request_id)
            raise


def engine_error(output: RequestOutput) -> APIError:
    """A request that failed in the engine (finish reason 'error'): a 500 with the engine's reason."""
    return APIError(500, f"the request failed in the engine: {output.error}", None, "server_error")


def usage(prompt_tokens: int, streams: Sequence[ChoiceStream]) -> dict:
    """OpenAI's usage counts; ``prompt_tokens_details.cached_tokens``: the first sequence's prompt
    tokens served from the prefix cache."""
    completion = sum(len(s.tokens) for s in streams)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": streams[0].cached_tokens},
    }


def speculation(streams: Sequence[ChoiceStream]) -> dict:
    """The request's speculative decoding over its sequences (jaxkv's extension of the response):
    draft tokens ``proposed`` and ``accepted``, verifying ``steps``, ``acceptance_rate`` and
    ``mean_accepted_length`` (``SpeculationStats.as_dict``; zeros without speculation)."""
    return SpeculationStats(
        proposed=sum(s.speculation.proposed for s in streams),
        accepted=sum(s.speculation.accepted for s in streams),
        steps=sum(s.speculation.steps for s in streams),
    ).as_dict()


def completion_logprobs(tokenizer, entries: Sequence[dict]) -> dict | None:
    """OpenAI completions' ``logprobs`` object for a sequence's tokens."""
    return {
        "tokens": [tokenizer.decode([e["token"]], skip_special_tokens=False) for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{tokenizer.decode([t], skip_special_tokens=False): x for t, x in e["top"]} for e in entries],
        "text_offset": [],
    }


def chat_logprobs(tokenizer, entries: Sequence[dict]) -> dict:
    def token(entry_token, logprob, top=()):
        text = tokenizer.decode([entry_token], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": list(top)}

    return {"content": [token(e["token"], e["logprob"], [token(t, x) for t, x in e["top"]]) for e in entries]}


def create_app(server: Server) -> FastAPI:
    """The FastAPI application over ``server``."""
    app = FastAPI(title="jaxkv", docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app, lambda status: server.metrics.requests.labels(f"error_{status}").inc())

    @app.get("/health")
    async def health():
        if not server.runner.alive:
            return JSONResponse({"status": "engine stopped", "error": server.runner.failure}, status_code=503)
        if not server.runner.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": server.model_name, "object": "model", "created": 0, "owned_by": "jaxkv",
                "max_model_len": server.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(server.runner.stats()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = validated(CompletionRequest, await read_json(request))
        return await respond(server, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = validated(ChatRequest, await read_json(request))
        return await respond(server, body, request, chat=True)

    return app


async def respond(server: Server, body: CompletionRequest | ChatRequest, request: Request, chat: bool):
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    # Off the event loop: tokenizing and queueing may wait for the engine's current step.
    request_id, prompt_tokens = await asyncio.to_thread(server.submit, body, queue, loop)
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    streams = [ChoiceStream() for _ in range(body.n)]
    started = time.perf_counter()
    outputs = server.outputs(request, request_id, queue, body.n)
    if body.stream:
        chunks = stream_chunks(server, body, response_id, streams, outputs, prompt_tokens, chat, started)
        return StreamingResponse(chunks, media_type="text/event-stream")
    failed = None
    async for output in outputs:
        streams[output.index].take(output)
        failed = output if output.finish_reason == "error" else failed
    if failed is not None:
        raise engine_error(failed)
    server.metrics.requests.labels("completed").inc()
    return whole_response(server, body, response_id, streams, prompt_tokens, chat)


def whole_response(
    server: Server, body, response_id: str, streams: Sequence[ChoiceStream], prompt_tokens: int, chat: bool
):
    tokenizer, choices = server.tokenizer, []
    for index, stream in enumerate(streams):
        if chat:
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": stream.sent_text},
                "finish_reason": stream.finish_reason,
                "logprobs": chat_logprobs(tokenizer, stream.logprobs) if body.logprobs else None,
            }
        else:
            choice = {
                "index": index,
                "text": stream.sent_text,
                "finish_reason": stream.finish_reason,
                "logprobs": completion_logprobs(tokenizer, stream.logprobs) if body.logprobs is not None else None,
            }
        choices.append(choice)
    return {
        "id": response_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": server.model_name,
        "choices": choices,
        "usage": usage(prompt_tokens, streams),
        "speculation": speculation(streams),
    }


async def stream_chunks(server: Server, body, response_id, streams, outputs, prompt_tokens, chat, started):
    """Server-sent events: a chunk per new piece of text (with usage, if continuous usage was
    asked), then usage if asked, then [DONE]; a request that fails in the engine ends with an
    error event (OpenAI's error body) before [DONE]."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list, with_usage: bool = body.continuous_usage()) -> str:
        chunk = {"id": response_id, "object": kind, "created": created, "model": server.model_name, "choices": choices}
        if with_usage:
            chunk["usage"] = usage(prompt_tokens, streams)
            chunk["speculation"] = speculation(streams)
        return f"data: {json.dumps(chunk)}\n\n"

    if chat:
        yield event(
            [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(body.n)]
        )
    first_token = failure = None
    try:
        async for output in outputs:
            text = streams[output.index].take(output)
            if first_token is None and output.new_token_ids:
                first_token = time.perf_counter()
                server.metrics.ttft.observe(first_token - started)
            if output.finish_reason == "error":
                failure = engine_error(output)
            elif text or output.finished:
                yield event([chunk_choice(server.tokenizer, body, output, text, chat)])
    except ClientDisconnected:
        return  # ``outputs`` aborted and logged the request; nobody is left to read the rest
    if failure is not None:
        server.metrics.requests.labels("error_500").inc()
        yield f"data: {json.dumps(error_body(failure.message, failure.param, failure.kind))}\n\n"
    else:
        if first_token is not None:
            generated = sum(len(s.tokens) for s in streams)
            if generated > 1:
                server.metrics.tpot.observe((time.perf_counter() - first_token) / (generated - 1))
        server.metrics.requests.labels("completed").inc()
        if body.stream_options is not None and body.stream_options.include_usage:
            yield event([], with_usage=True)
    yield "data: [DONE]\n\n"


def chunk_choice(tokenizer, body, output: RequestOutput, text: str, chat: bool) -> dict:
    """One streamed choice: the sequence's new ``text``, and its finish and logprobs."""
    new, finish_reason = list(output.logprobs), output.finish_reason if output.finished else None
    if chat:
        logprobs = chat_logprobs(tokenizer, new) if body.logprobs else None
        return {"index": output.index, "delta": {"content": text} if text else {}, "finish_reason": finish_reason,
                "logprobs": logprobs}  # fmt: skip
    logprobs = completion_logprobs(tokenizer, new) if body.logprobs is not None else None
    return {"index": output.index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


def serve(server: Server, host: str, port: int, log_level: str = "warning") -> None:
    """Run the app with uvicorn until SIGINT/SIGTERM; then stop taking connections, finish the
    requests in flight, stop the engine thread and return (exit status 0)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server, except that it does not re-raise the signal it stopped on (which would
        end the process before the engine thread stops)."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(
        create_app(server), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=120
    )
    try:
        DrainingServer(config).run()
    finally:
        server.runner.stop()
