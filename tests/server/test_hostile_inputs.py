"""``jaxkv serve`` against hostile and malformed requests (one real server for the file): each
request of ``MALFORMED`` (wrong types, out-of-range values, oversized, badly encoded or deeply
nested bodies, wrong methods and paths) gets a 4xx in OpenAI's error shape naming the field,
never a 500; after all of them the server is healthy and answers normally. A body not sent as
``application/json`` (text/plain, a form, no Content-Type: what a web page can make a browser
send without a CORS preflight; a charset other than UTF-8) is a 415 on both POST routes and
never runs, whatever the body holds; JSON with a UTF-8 charset is taken. Also what the
server promises about its limits: a refused request keeps the connection, ``/health`` stays
fast while a request holds back text against long stop strings, and a chat request without
``max_tokens`` runs to the context limit."""

import concurrent.futures
import http.client
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxkv.server.errors import MAX_BODY_BYTES
from jaxkv.server.schemas import MAX_STOP_LENGTH
from tests.server.conftest import MODEL

pytestmark = pytest.mark.server

CONTEXT = 128  # a chat without max_tokens runs to it: every token of it is a decode step
SERVER_ARGS = ("--kv-memory", "64MiB", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
               "--max-model-len", str(CONTEXT), "--max-waiting", "8")  # fmt: skip
OK = {"model": MODEL, "prompt": "The three primary colors are", "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
SURROGATE = '"ab\\ud800cd"'  # a JSON string holding a lone UTF-16 surrogate


def completion(**fields) -> dict:
    return {key: value for key, value in (OK | fields).items() if value is not None}


def chat(**fields) -> dict:
    return {key: value for key, value in (CHAT | fields).items() if value is not None}


def raw(text: str) -> bytes:
    return text.encode()


def with_surrogate(body: dict) -> bytes:
    """``body`` as JSON, its string ``"@@"`` replaced by one holding a lone surrogate."""
    return json.dumps(body).replace('"@@"', SURROGATE).encode()


# (method, path, body: a dict sent as JSON or raw bytes, expected status, expected param or None for "any")
COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"
MALFORMED = {
    # paths and methods
    "unknown path": ("GET", "/nope", None, 404, None),
    "unknown v1 path": ("POST", "/v1/embeddings", completion(), 404, None),
    "encoded dot path": ("GET", "/v1/%2e%2e/secret", None, 404, None),
    "GET completions": ("GET", COMPLETIONS, None, 405, None),
    "PUT chat": ("PUT", CHATS, chat(), 405, None),
    "PATCH completions": ("PATCH", COMPLETIONS, completion(), 405, None),
    "DELETE health": ("DELETE", "/health", None, 405, None),
    "POST models": ("POST", "/v1/models", {}, 405, None),
    "OPTIONS metrics": ("OPTIONS", "/metrics", None, 405, None),
    # encodings and sizes
    "empty body": ("POST", COMPLETIONS, b"", 400, None),
    "not UTF-8": ("POST", COMPLETIONS, b'{"model": "\xff\xfe"}', 400, None),
    "latin-1 body": ("POST", COMPLETIONS, '{"model": "smollm2", "prompt": "caf\xe9"}'.encode("latin-1"), 400, None),
    "UTF-16 body": ("POST", COMPLETIONS, json.dumps(completion()).encode("utf-16"), 400, None),
    "overlong UTF-8": ("POST", COMPLETIONS, b'{"model": "smollm2", "prompt": "\xc0\xaf"}', 400, None),
    "form encoded": ("POST", COMPLETIONS, b"model=smollm2&prompt=hi", 400, None),
    "truncated JSON": ("POST", COMPLETIONS, raw('{"model": "smollm2", "prompt": "x"'), 400, None),
    "trailing garbage": ("POST", COMPLETIONS, raw(json.dumps(completion()) + "}"), 400, None),
    "over the size limit": ("POST", COMPLETIONS, completion(prompt="a" * (MAX_BODY_BYTES + 1)), 413, None),
    "integer of 5000 digits": ("POST", COMPLETIONS, raw('{"model": "smollm2", "prompt": "x", "seed": 1' + "0" * 5000 + "}"), 400, None),  # noqa: E501
    # nesting
    "arrays 100k deep": ("POST", COMPLETIONS, raw("[" * 100_000 + "]" * 100_000), 400, None),
    "objects 100k deep": ("POST", CHATS, raw('{"a":' * 100_000 + "1" + "}" * 100_000), 400, None),
    "prompt nested 500 deep": ("POST", COMPLETIONS, raw('{"model": "smollm2", "prompt": ' + "[" * 500 + "1" + "]" * 500 + "}"), 400, "prompt.0"),  # noqa: E501
    "body an array": ("POST", COMPLETIONS, [], 400, None),
    "body a string": ("POST", CHATS, raw('"hello"'), 400, None),
    "body null": ("POST", COMPLETIONS, raw("null"), 400, None),
    # text that is not valid Unicode
    "surrogate prompt": ("POST", COMPLETIONS, with_surrogate(completion(prompt="@@")), 400, "prompt"),
    "surrogate message": ("POST", CHATS, with_surrogate(chat(messages=[{"role": "user", "content": "@@"}])), 400, "messages.0.content"),  # noqa: E501
    "surrogate text part": ("POST", CHATS, with_surrogate(chat(messages=[{"role": "user", "content": [{"type": "text", "text": "@@"}]}])), 400, "messages.0.content.0.text"),  # noqa: E501
    "surrogate stop": ("POST", COMPLETIONS, with_surrogate(completion(stop=["ok", "@@"])), 400, "stop.1"),
    "surrogate model": ("POST", COMPLETIONS, with_surrogate(completion(model="@@")), 400, "model"),
    "surrogate field name": ("POST", COMPLETIONS, raw(json.dumps(completion())[:-1] + ', "\\ud800": 1}'), 400, None),
    # types
    "model int": ("POST", COMPLETIONS, completion(model=7), 400, "model"),
    "prompt int": ("POST", COMPLETIONS, completion(prompt=7), 400, "prompt"),
    "prompt list of strings": ("POST", COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt.0"),
    "prompt float ids": ("POST", COMPLETIONS, completion(prompt=[1.5]), 400, "prompt.0"),
    "max_tokens string": ("POST", COMPLETIONS, completion(max_tokens="16"), 400, "max_tokens"),
    "max_tokens float": ("POST", COMPLETIONS, completion(max_tokens=1.5), 400, "max_tokens"),
    "n bool": ("POST", COMPLETIONS, completion(n=True), 400, "n"),
    "stream string": ("POST", COMPLETIONS, completion(stream="yes"), 400, "stream"),
    "stop int": ("POST", COMPLETIONS, completion(stop=[1]), 400, "stop.0"),
    "stream_options string": ("POST", COMPLETIONS, completion(stream_options="usage"), 400, "stream_options"),
    "cache_salt int": ("POST", COMPLETIONS, completion(cache_salt=5), 400, "cache_salt"),
    "messages a string": ("POST", CHATS, chat(messages="hi"), 400, "messages"),
    "content null": ("POST", CHATS, chat(messages=[{"role": "user", "content": None}]), 400, "messages.0.content"),
    # ranges
    "token id past the vocabulary": ("POST", COMPLETIONS, completion(prompt=[10**9]), 400, "prompt"),
    "negative token id": ("POST", COMPLETIONS, completion(prompt=[-1]), 400, "prompt"),
    "empty token list": ("POST", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    "prompt past the context": ("POST", COMPLETIONS, completion(prompt=[42] * (CONTEXT + 10)), 400, "prompt"),
    "messages past the context": ("POST", CHATS, chat(messages=[{"role": "user", "content": "word " * CONTEXT}]), 400, "messages"),  # noqa: E501
    "max_tokens 0": ("POST", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens"),
    "max_tokens -1": ("POST", COMPLETIONS, completion(max_tokens=-1), 400, "max_tokens"),
    "max_tokens past the context": ("POST", COMPLETIONS, completion(max_tokens=10**6), 400, "max_tokens"),
    "n 0": ("POST", COMPLETIONS, completion(n=0), 400, "n"),
    "n past the rows": ("POST", COMPLETIONS, completion(n=100), 400, "n"),
    "seed -1": ("POST", COMPLETIONS, completion(seed=-1), 400, "seed"),
    "seed 2**32": ("POST", COMPLETIONS, completion(seed=2**32), 400, "seed"),
    "seed 2**64": ("POST", COMPLETIONS, completion(seed=2**64), 400, "seed"),
    "top_k 2**31": ("POST", COMPLETIONS, completion(top_k=2**31), 400, "top_k"),
    "top_k -2": ("POST", COMPLETIONS, completion(top_k=-2), 400, "top_k"),
    "top_p 0": ("POST", COMPLETIONS, completion(top_p=0), 400, "top_p"),
    "top_p 1.5": ("POST", COMPLETIONS, completion(top_p=1.5), 400, "top_p"),
    "min_p -0.1": ("POST", COMPLETIONS, completion(min_p=-0.1), 400, "min_p"),
    "temperature 1e39": ("POST", COMPLETIONS, completion(temperature=1e39), 400, "temperature"),
    "temperature -1": ("POST", COMPLETIONS, completion(temperature=-1), 400, "temperature"),
    "temperature Infinity": ("POST", COMPLETIONS, raw('{"model": "smollm2", "prompt": "x", "temperature": Infinity}'), 400, "temperature"),  # noqa: E501
    "temperature NaN": ("POST", CHATS, raw(json.dumps(chat())[:-1] + ', "temperature": NaN}'), 400, "temperature"),
    "logprobs past the limit": ("POST", COMPLETIONS, completion(logprobs=10**6), 400, "logprobs"),
    "top_logprobs past the limit": ("POST", CHATS, chat(logprobs=True, top_logprobs=10**6), 400, "top_logprobs"),
    "five stop strings": ("POST", COMPLETIONS, completion(stop=list("abcde")), 400, "stop"),
    "stop string too long": ("POST", COMPLETIONS, completion(stop="x" * (MAX_STOP_LENGTH + 1)), 400, "stop.0"),
    "stop string of a million": ("POST", COMPLETIONS, completion(stop=["x" * 10**6]), 400, "stop.0"),
    "empty stop string": ("POST", COMPLETIONS, completion(stop=""), 400, "stop.0"),
    "messages empty": ("POST", CHATS, chat(messages=[]), 400, "messages"),
    # fields and values this server does not take
    "unknown field": ("POST", COMPLETIONS, completion(frobnicate=1), 400, "frobnicate"),
    "unknown stream option": ("POST", COMPLETIONS, completion(stream_options={"include_usage": True, "x": 1}), 400, "stream_options.x"),  # noqa: E501
    "unknown model": ("POST", COMPLETIONS, completion(model="gpt-9"), 404, "model"),
    "missing model": ("POST", COMPLETIONS, completion(model=None), 400, "model"),
    "missing prompt": ("POST", COMPLETIONS, completion(prompt=None), 400, "prompt"),
    "min_tokens 5": ("POST", COMPLETIONS, completion(min_tokens=5), 400, "min_tokens"),
    "repetition_penalty 1.3": ("POST", CHATS, chat(repetition_penalty=1.3), 400, "repetition_penalty"),
    "frequency_penalty 0.5": ("POST", CHATS, chat(frequency_penalty=0.5), 400, "frequency_penalty"),
    "role tool": ("POST", CHATS, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages.0.role"),
    "message without role": ("POST", CHATS, chat(messages=[{"content": "x"}]), 400, "messages.0.role"),
    "image part": ("POST", CHATS, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "messages.0.content.0"),  # noqa: E501
    "part without type": ("POST", CHATS, chat(messages=[{"role": "user", "content": [{"text": "x"}]}]), 400, "messages.0.content.0"),  # noqa: E501
    "both token limits": ("POST", CHATS, chat(max_completion_tokens=4), 400, "max_completion_tokens"),
    "max_completion_tokens 0": ("POST", CHATS, chat(max_tokens=None, max_completion_tokens=0), 400, "max_completion_tokens"),  # noqa: E501
}  # fmt: skip


def send(url: str, method: str, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"} if content is not None else {}
    return httpx.request(method, f"{url}{path}", content=content, headers=headers, timeout=60)


def test_there_are_at_least_50_malformed_requests():
    assert len(MALFORMED) >= 50


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_request_gets_a_4xx_in_openai_shape(server, case):
    method, path, body, status, param = MALFORMED[case]
    response = send(server[1], method, path, body)
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and error["type"], error
    if param is not None:
        assert error["param"] == param, error
    if error["param"] is not None:
        assert not error["param"].isdigit(), error  # a field, never a character offset


def test_the_messages_name_what_is_wrong(server):
    """A few errors whose message matters as much as the field: both token limits are named, a
    non-text part names its type, a deep body says it nests too deeply, a wrong method says
    which methods the path takes."""
    url = server[1]
    checks = {"both token limits": ("max_tokens", "max_completion_tokens"), "image part": ("'image_url'",),
              "arrays 100k deep": ("nests too deeply",), "GET completions": ("POST",),
              "temperature 1e39": ("less than or equal to 2",), "not UTF-8": ("not UTF-8",)}  # fmt: skip
    for case, words in checks.items():
        message = send(url, *MALFORMED[case][:3]).json()["error"]["message"]
        assert all(word in message for word in words), (case, message)


# Content-Types a POST body is refused with (None: no Content-Type header at all).
NOT_JSON = [
    "text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
    None, "application/json; charset=latin-1", "application/jsonx",
]  # fmt: skip
ROUTES = {"completions": (COMPLETIONS, completion()), "chat": (CHATS, chat())}


def post_as(url: str, path: str, content: bytes, content_type: str | None) -> httpx.Response:
    """POST ``content`` with exactly this Content-Type (None: without the header)."""
    headers = {} if content_type is None else {"content-type": content_type}
    response = httpx.post(f"{url}{path}", content=content, headers=headers, timeout=120)
    assert response.request.headers.get("content-type") == content_type  # httpx added none of its own
    return response


def request_outcomes(url: str) -> dict[str, float]:
    """The server's ``jaxkv_requests_total`` by outcome label (outcomes never seen are absent)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    (family,) = (f for f in families if f.name == "jaxkv_requests")
    return {s.labels["outcome"]: s.value for s in family.samples if s.name == "jaxkv_requests_total"}


@pytest.mark.parametrize("content_type", NOT_JSON)
@pytest.mark.parametrize("route", ROUTES)
def test_a_body_not_sent_as_json_is_refused_with_415_and_never_runs(server, route, content_type):
    """A valid request's JSON, sent with another Content-Type (or none): a 415 in OpenAI's shape
    naming the type received and the one required, and nothing generated."""
    url, (path, body) = server[1], ROUTES[route]
    before = request_outcomes(url)
    response = post_as(url, path, json.dumps(body).encode(), content_type)
    assert response.status_code == 415, response.text[:500]
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None and error["code"] is None, error
    received = "no Content-Type" if content_type is None else repr(content_type)
    assert received in error["message"] and "application/json" in error["message"], error
    after = request_outcomes(url)
    assert after.get("completed", 0) == before.get("completed", 0)
    assert after["error_415"] == before.get("error_415", 0) + 1


def test_the_content_type_is_checked_before_the_body_is_read(server):
    """text/plain over the size limit: a 415, not the 413 that reading it would give."""
    response = post_as(server[1], COMPLETIONS, b"x" * (MAX_BODY_BYTES + 1), "text/plain")
    assert response.status_code == 415, response.text[:500]


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON; Charset=UTF-8"])
@pytest.mark.parametrize("route", ROUTES)
def test_json_with_a_utf8_charset_is_taken(server, route, content_type):
    path, body = ROUTES[route]
    response = post_as(server[1], path, json.dumps(body).encode(), content_type)
    assert response.status_code == 200, response.text[:500]
    assert response.json()["usage"]["completion_tokens"] == 4


def test_after_all_of_them_the_server_is_healthy_and_answers(server):
    url = server[1]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    done = httpx.post(f"{url}/v1/completions", json=OK, timeout=120)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
    reply = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=120)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]


def test_a_refused_request_keeps_the_connection(server):
    """A lone surrogate is a 400 on a connection that stays open: the next request goes over
    the same socket."""
    host, port = server[1].removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        for path, body in ((COMPLETIONS, with_surrogate(completion(prompt="@@"))),
                           (CHATS, with_surrogate(chat(messages=[{"role": "user", "content": "@@"}])))):  # fmt: skip
            connection.request("POST", path, body, {"content-type": "application/json"})
            response = connection.getresponse()
            assert response.status == 400 and not response.will_close
            response.read()
            socket = connection.sock
            connection.request("GET", "/health")
            health = connection.getresponse()
            assert health.status == 200 and connection.sock is socket
            health.read()
    finally:
        connection.close()


def test_health_stays_fast_while_text_is_held_back_against_long_stop_strings(server):
    """Four stop strings of the longest length that the output keeps matching the start of:
    the stream holds its text back for as long as it can, and ``/health`` (probed every 20 ms
    while the stream runs) answers in under 100 ms: 99% of the probes, and every one in under
    a second, leaving room for a busy 2-core machine to delay a thread now and then (the work
    per chunk was seconds before the stop strings were bounded). 80 tokens: about 370 characters."""
    url = server[1]
    body = completion(max_tokens=80, ignore_eos=True)
    text = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
    assert len(text) >= MAX_STOP_LENGTH
    stops = [text[: MAX_STOP_LENGTH - 1] + end for end in "\x01\x02\x03\x04"]

    def stream() -> str:
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stop": stops, "stream": True},
                          timeout=300) as response:  # fmt: skip
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: {")]
        return "".join(json.loads(event)["choices"][0]["text"] for event in events)

    latencies = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.Client(timeout=10) as probe:
        probe.get(f"{url}/health")  # the probe's connection is open before the clock starts
        streamed = pool.submit(stream)
        while not streamed.done():
            started = time.perf_counter()
            assert probe.get(f"{url}/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    assert streamed.result() == text  # no stop string matched, and the text came out whole
    slowest = sorted(latencies)
    assert len(slowest) >= 10 and slowest[int(0.99 * len(slowest))] < 0.1 and slowest[-1] < 1, slowest[-5:]


def test_a_chat_without_max_tokens_runs_to_the_context_limit(server):
    done = httpx.post(f"{server[1]}/v1/chat/completions", json=chat(max_tokens=None, ignore_eos=True), timeout=600)
    assert done.status_code == 200, done.text
    usage = done.json()["usage"]
    assert usage["completion_tokens"] == CONTEXT - usage["prompt_tokens"]
    assert done.json()["choices"][0]["finish_reason"] == "length"
