"""``jaxkv serve``: an OpenAI-compatible HTTP server over the serving engine.

    jaxkv serve --model smollm2 --host 127.0.0.1 --port 8000 --kv-memory 1GiB

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the model's chat
template), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). The engine
steps in its own thread (``EngineThread``); each request's outputs reach its handler through
an asyncio queue. Bad requests get an OpenAI-style error body and a 4xx status naming the
field; past ``max_waiting`` queued requests the server answers 503 with ``Retry-After``; a
client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from jaxkv.decoding.sampling import Sampling
from jaxkv.serving.engine_thread import EngineThread
from jaxkv.serving.requests import RequestError, RequestOutput


# --- request bodies (OpenAI's fields; an unknown field is an error naming it) -----------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CommonParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # 0 or -1: all tokens (vLLM's -1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None  # extension: only requests with the same salt share prefix pages
    user: str | None = None

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, max(self.top_k, 0), self.top_p, self.min_p)

    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(CommonParams):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(CommonParams):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)


# --- errors ----------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_response(status: int, message: str, param: str | None, kind: str, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


# --- metrics ---------------------------------------------------------------------------------
class Metrics:
    """The server's Prometheus metrics (its own registry, so several servers can live in one process)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("jaxkv_requests", "requests by outcome", ["outcome"], registry=self.registry)
        self.ttft = Histogram("jaxkv_time_to_first_token_seconds", "time to first token", registry=self.registry)
        self.tpot = Histogram("jaxkv_time_per_output_token_seconds", "time per output token", registry=self.registry)
        self.gauges = {
            name: Gauge(f"jaxkv_{name}", help_text, registry=self.registry)
            for name, help_text in {
                "running_requests": "sequences holding a row",
                "waiting_requests": "sequences waiting for a row or pages",
                "pages_used": "pages in use over all pools",
                "pages_free": "free pages over all pools (cached ones included)",
                "prefix_cache_hit_rate": "prompt tokens served from the prefix cache",
                "preemptions": "sequences preempted since start",
            }.items()
        }

    def render(self, stats: dict) -> bytes:
        pools = stats["pages"].values()
        values = {
            "running_requests": stats["num_running"],
            "waiting_requests": stats["num_waiting"],
            "pages_used": sum(p["used"] for p in pools),
            "pages_free": sum(p["free"] for p in pools),
            "prefix_cache_hit_rate": stats["prefix_hit_rate"],
            "preemptions": stats["preemptions"],
        }
        for name, value in values.items():
            self.gauges[name].set(value)
        return generate_latest(self.registry)


# --- one request's stream of outputs -----------------------------------------------------------
class ChoiceStream:
    """What the server has sent of one choice (one sequence of the request): its text, tokens
    and logprobs so far. The engine decides what text is safe to send (``RequestOutput.delta``)."""

    def __init__(self):
        self.sent_text, self.tokens, self.logprobs = "", [], []
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens the prefix cache served

    def take(self, output: RequestOutput) -> str:
        """Record ``output``; returns its new text."""
        self.tokens += output.new_token_ids
        self.logprobs += list(output.logprobs)
        self.cached_tokens = output.num_cached_tokens
        self.sent_text += output.delta
        if output.finished:
            self.finish_reason = output.finish_reason
        return output.delta


class Server:
    """The engine runner, the tokenizer and the model's name behind the HTTP endpoints."""

    def __init__(self, runner: EngineThread, tokenizer, model_name: str, max_waiting: int = 64):
        self.runner, self.tokenizer, self.model_name, self.max_waiting = runner, tokenizer, model_name, max_waiting
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
            messages = [m.model_dump() for m in body.messages]
            try:
                text = self.tokenizer.apply_chat_template(messages)
            except Exception as error:  # a template without a chat format, or one that refuses the roles
                raise APIError(400, f"the model's chat template cannot format these messages: {error}", "messages")
            return self.tokenizer.encode(text, add_special_tokens=False)
        if isinstance(body.prompt, str):
            return self.tokenizer.encode(body.prompt)
        return list(body.prompt)

    def submit(self, body: CompletionRequest | ChatRequest, queue: asyncio.Queue, loop) -> tuple[int, int]:
        """Queue the request on the engine; returns its id and prompt length. Errors name the field."""
        prompt = self.prompt_ids(body)
        stats = self.runner.stats()
        if stats["num_waiting"] >= self.max_waiting:
            raise APIError(503, f"{stats['num_waiting']} requests are waiting; retry later", None, "server_busy")
        top = body.logprobs if isinstance(body, CompletionRequest) else (body.top_logprobs or 0)
        options = dict(
            sampling=body.sampling(),
            max_tokens=body.max_tokens or 16,
            stop=body.stops(),
            seed=body.seed,
            cache_salt=body.cache_salt,
            n=body.n,
            logprobs=top or 0,
        )
        try:
            request_id = self.runner.submit(
                prompt, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out), **options
            )
        except RequestError as error:
            raise APIError(400, str(error), _API_FIELDS.get(error.param, error.param)) from None
        except RuntimeError as error:
            raise APIError(503, str(error), None, "server_busy") from None
        return request_id, len(prompt)

    async def outputs(self, request: Request, request_id: int, queue: asyncio.Queue, n: int) -> AsyncIterator:
        """The request's outputs until all ``n`` sequences finished; aborts it if the client leaves."""
        finished = 0
        try:
            while finished < n:
                try:
                    output = await asyncio.wait_for(queue.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError from None
                    continue
                finished += output.finished
                yield output
                if output.finished and output.finish_reason == "abort":
                    finished = n
        except (asyncio.CancelledError, GeneratorExit):
            self.runner.abort(request_id)
            self.metrics.requests.labels("disconnected").inc()
            raise


# Engine argument -> the API field a client set.
_API_FIELDS = {"prompt_ids": "prompt", "stop_token_ids": "stop_token_ids"}


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
    app = FastAPI(title="jaxkv", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        headers = {"Retry-After": "1"} if error.status == 503 else None
        server.metrics.requests.labels(f"error_{error.status}").inc()
        return error_response(error.status, error.message, error.param, error.kind, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, error: RequestValidationError):
        first = error.errors()[0]
        location = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {message}"
        server.metrics.requests.labels("error_400").inc()
        return error_response(
            400, f"{'.'.join(location) or 'body'}: {message}", ".".join(location) or None, "invalid_request_error"
        )

    @app.exception_handler(Exception)
    async def internal(_, error: Exception):
        """A bug still answers in OpenAI's shape, without a traceback (uvicorn logs it)."""
        server.metrics.requests.labels("error_500").inc()
        return error_response(500, f"internal error: {type(error).__name__}", None, "server_error")

    @app.get("/health")
    async def health():
        if not server.runner.accepting:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": server.model_name, "object": "model", "created": 0, "owned_by": "jaxkv"}],
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(server.runner.stats()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(server, body, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
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
    async for output in outputs:
        streams[output.index].take(output)
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
    }


async def stream_chunks(server: Server, body, response_id, streams, outputs, prompt_tokens, chat, started):
    """Server-sent events: a chunk per new piece of text, then usage if asked, then [DONE]."""
    created, tokenizer = int(time.time()), server.tokenizer
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(choices: list, **extra) -> str:
        chunk = {
            "id": response_id,
            "object": kind,
            "created": created,
            "model": server.model_name,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(chunk)}\n\n"

    if chat:
        yield event(
            [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None} for i in range(body.n)]
        )
    first_token = None
    async for output in outputs:
        stream = streams[output.index]
        text = stream.take(output)
        if first_token is None and output.new_token_ids:
            first_token = time.perf_counter()
            server.metrics.ttft.observe(first_token - started)
        if not text and not output.finished:
            continue
        new = list(output.logprobs)
        if chat:
            choice = {
                "index": output.index,
                "delta": {"content": text} if text else {},
                "finish_reason": output.finish_reason if output.finished else None,
                "logprobs": chat_logprobs(tokenizer, new) if body.logprobs else None,
            }
        else:
            choice = {
                "index": output.index,
                "text": text,
                "finish_reason": output.finish_reason if output.finished else None,
                "logprobs": completion_logprobs(tokenizer, new) if body.logprobs is not None else None,
            }
        yield event([choice])
    if first_token is not None:
        generated = sum(len(s.tokens) for s in streams)
        if generated > 1:
            server.metrics.tpot.observe((time.perf_counter() - first_token) / (generated - 1))
    server.metrics.requests.labels("completed").inc()
    if body.stream_options is not None and body.stream_options.include_usage:
        yield event([], usage=usage(prompt_tokens, streams))
    yield "data: [DONE]\n\n"


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
