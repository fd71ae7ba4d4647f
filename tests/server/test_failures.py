"""The engine thread and the app when something fails, in process on a tiny Llama (token-id
prompts, no tokenizer): a request that fails in a step fails alone (a 500 in OpenAI's shape,
or an error event ending its stream) and the next request runs; an error escaping the engine
ends the thread, fails what was in flight, turns ``/health`` to 503 and refuses new requests
with a 503; a sink that raises aborts only its request; ``max_waiting`` holds under concurrent
submissions; a client that disconnects (a real socket closed before the answer) has its
request aborted and its pages freed, with one INFO line and no ERROR record in the log."""

import concurrent.futures
import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from jaxkv.models.llama import Llama, LlamaConfig

from jaxkv.server.api import Server, create_app
from jaxkv.serving import Engine
from jaxkv.serving.engine_thread import EngineThread, EngineUnavailable
from jaxkv.serving.requests import RequestOptions
from tests.cases import TINY_LLAMA

SMALL = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, kv_memory=64 * 1024)
PROMPT = [3, 14, 15, 9, 26, 5]
NAME = "tiny"
POISON = 13  # requests with this max_tokens fail in the model runner (test_a_request_that_fails_...)


@pytest.fixture(scope="module")
def llama():
    return Llama(LlamaConfig(**TINY_LLAMA | {"max_position_embeddings": 256, "eos_token_id": 7}))


@contextlib.contextmanager
def serving(llama, **thread_options):
    """A started engine thread over a fresh engine, and a test client of the app over it."""
    thread = EngineThread(Engine(llama, **SMALL), **thread_options).start()
    try:
        with TestClient(create_app(Server(thread, None, NAME))) as client:
            yield thread, client
    finally:
        thread.stop(timeout=60)


@contextlib.contextmanager
def serving_over_http(llama):
    """A started engine thread over a fresh engine, and the app served by uvicorn in a thread of
    this process on a loopback socket: yields the engine thread, the ``Server`` and the base URL.
    ``log_config=None``: uvicorn's records go to the root logger (where caplog reads them), not
    to handlers of its own."""
    thread = EngineThread(Engine(llama, **SMALL | {"kv_memory": 256 * 1024})).start()
    server = Server(thread, None, NAME)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    http = uvicorn.Server(uvicorn.Config(create_app(server), log_config=None, lifespan="off"))
    runner = threading.Thread(target=http.run, kwargs={"sockets": [listener]}, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while not http.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.started, "uvicorn did not start in 60 s"
        yield thread, server, f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        http.should_exit = True
        runner.join(60)
        thread.stop(timeout=60)
        listener.close()


def body(max_tokens: int, **extra) -> dict:
    return {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | extra


def assert_openai_error(payload: dict, kind: str, text: str) -> None:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == kind, error
    assert text in error["message"], error


@pytest.mark.filterwarnings("ignore:engine step failed")
def test_a_request_that_fails_in_a_step_fails_alone_and_the_next_one_runs(llama, monkeypatch):
    with serving(llama) as (thread, client):
        run = thread.engine.runner.run

        def failing(chunks, *args):
            if any(chunk.seq.options.max_tokens == POISON for chunk in chunks):
                raise RuntimeError("injected device failure")
            return run(chunks, *args)

        monkeypatch.setattr(thread.engine.runner, "run", failing)
        whole = client.post("/v1/completions", json=body(POISON))
        assert whole.status_code == 500
        assert_openai_error(whole.json(), "server_error", "injected device failure")
        with client.stream("POST", "/v1/completions", json=body(POISON, stream=True)) as stream:
            assert stream.status_code == 200
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert_openai_error(json.loads(events[-2]), "server_error", "injected device failure")
        done = client.post("/v1/completions", json=body(6))
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 6
        assert done.json()["choices"][0]["finish_reason"] == "length"
        assert thread.alive and client.get("/health").json() == {"status": "ok"}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_error_escaping_the_engine_stops_the_thread_and_health_answers_503(llama, monkeypatch):
    with serving(llama) as (thread, client):

        def broken():
            raise RuntimeError("injected engine bug")

        monkeypatch.setattr(thread.engine, "step", broken)
        in_flight = client.post("/v1/completions", json=body(6))
        assert in_flight.status_code == 500
        assert_openai_error(in_flight.json(), "server_error", "injected engine bug")
        thread.stop(timeout=60)
        assert not thread.alive and "injected engine bug" in thread.failure
        health = client.get("/health")
        assert health.status_code == 503 and "injected engine bug" in health.json()["error"]
        refused = client.post("/v1/completions", json=body(6))
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert_openai_error(refused.json(), "server_busy", "the engine stopped after an error")


def test_a_sink_that_raises_aborts_only_its_request(llama):
    thread = EngineThread(Engine(llama, **SMALL)).start()
    received, done = [], threading.Event()

    def gone(output):
        raise RuntimeError("the client's queue is closed")

    def sink(output):
        received.append(output)
        if output.finished:
            done.set()

    try:
        with pytest.warns(UserWarning, match="the client's queue is closed"):
            thread.submit(PROMPT, gone, RequestOptions(max_tokens=40, ignore_eos=True))
            thread.submit(PROMPT[::-1], sink, RequestOptions(max_tokens=8, ignore_eos=True))
            assert done.wait(120)
        assert sum(len(o.new_token_ids) for o in received) == 8 and received[-1].finish_reason == "length"
        assert thread.alive
    finally:
        thread.stop(timeout=60)
    assert not thread.engine.sequences  # the aborted request was forgotten too


def test_max_waiting_holds_under_concurrent_submissions(llama):
    """16 threads submit at once to a thread that has not started stepping (nothing leaves
    the queue): exactly ``max_waiting`` are taken, the rest refused."""
    thread = EngineThread(Engine(llama, **SMALL), max_waiting=4)
    barrier = threading.Barrier(16)

    def submit(_):
        barrier.wait()
        try:
            return thread.submit(PROMPT, lambda output: None, RequestOptions(max_tokens=4))
        except EngineUnavailable as error:
            assert "the limit is 4" in str(error)
            return None

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        taken = [request_id for request_id in pool.map(submit, range(16)) if request_id is not None]
    assert len(taken) == 4 and thread.engine.stats().num_waiting == 4
    thread.start().stop(timeout=60)  # they all run to the end
    assert not thread.engine.has_unfinished()


def outcome_count(server: Server, outcome: str) -> float:
    """The server's ``jaxkv_requests_total`` for ``outcome`` (0 if never counted)."""
    return server.metrics.registry.get_sample_value("jaxkv_requests_total", {"outcome": outcome}) or 0


LEAVING = 200  # tokens the disconnecting request asks for: 4 s or more at the slowed step


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_disconnects_is_aborted_with_one_info_line_and_no_error(llama, monkeypatch, caplog, stream):
    """The client sends a request for ``LEAVING`` tokens over a real socket and closes it before
    the answer (a read timeout of 1 s; a stream: once it has begun), while the engine steps
    (slowed to 20 ms a step) are still running it. The request is aborted: the engine stops
    early, no page stays in use, the ``disconnected`` outcome is counted; the log holds one INFO
    line for it on ``jaxkv.server`` and no ERROR record (no "Exception in ASGI application")."""
    caplog.set_level(logging.INFO)
    # An earlier in-process uvicorn with its default logging config may have cut "uvicorn" off the root logger.
    monkeypatch.setattr(logging.getLogger("uvicorn"), "propagate", True)
    with serving_over_http(llama) as (thread, server, url):
        assert httpx.post(f"{url}/v1/completions", json=body(4), timeout=120).status_code == 200  # compiled
        run = thread.engine.runner.run

        def slow(*args):
            time.sleep(0.02)
            return run(*args)

        monkeypatch.setattr(thread.engine.runner, "run", slow)
        steps_before = thread.engine.runner.num_steps
        if stream:
            with httpx.stream("POST", f"{url}/v1/completions", json=body(LEAVING, stream=True), timeout=60) as response:
                assert response.status_code == 200  # the stream has begun; the client leaves
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json=body(LEAVING), timeout=httpx.Timeout(60, read=1.0))
        deadline = time.monotonic() + 30
        while outcome_count(server, "disconnected") == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert outcome_count(server, "disconnected") == 1 and outcome_count(server, "completed") == 1
    assert thread.engine.runner.num_steps - steps_before < LEAVING  # aborted, not run to its end
    assert not thread.engine.sequences
    assert sum(pool.used for pool in thread.engine.stats().pages.values()) == 0
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert not errors, [record.getMessage() for record in errors]
    lines = [record for record in caplog.records if record.name == "jaxkv.server"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, [record.getMessage() for record in lines]
    assert "disconnected" in lines[0].getMessage()
