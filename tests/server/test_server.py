"""``jaxkv serve`` as its users reach it: a real server process on 127.0.0.1 (a free port,
SmolLM2-135M), the official ``openai`` client, plain HTTP for what the client cannot send."""

import concurrent.futures
import json
import signal
import time

import httpx
import openai
import pytest
from jaxkv.models.load import load_pretrained

from jaxkv.decoding.generate import generate
from tests.server.conftest import MODEL

PROMPT = "The three primary colors are"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference():
    """Greedy continuations from ``generate`` (what the engine equals): each prompt's text, by
    prompt token ids, from one batch (rows are independent: one ``generate`` call for 32 prompts
    took 6 CPU s, one call per prompt 15)."""
    model, tokenizer = load_pretrained(MODEL)

    def greedy(prompts: list[list[int]], max_tokens=MAX_TOKENS) -> list[str]:
        result = generate(model, prompts, max_new_tokens=max_tokens, stop_tokens=tokenizer.eos_token_ids)
        return [tokenizer.decode(result.row(i)) for i in range(len(prompts))]

    return tokenizer, greedy


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(f"{server[1]}/health").json() == {"status": "ok"}


def test_greedy_completion_equals_the_engine_and_streams_the_same_text(client, reference):
    tokenizer, greedy = reference
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert whole.choices[0].text == greedy([tokenizer.encode(PROMPT)])[0]
    assert whole.usage.prompt_tokens == len(tokenizer.encode(PROMPT)) and whole.usage.completion_tokens <= MAX_TOKENS
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_chat_completion_applies_the_template(client, reference):
    tokenizer, greedy = reference
    messages = [{"role": "user", "content": "List three fruits."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert reply.choices[0].message.content == greedy([prompt])[0]
    assert reply.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream) == reply.choices[0].message.content


def test_seeded_samples_are_reproducible_and_stop_strings_cut(client):
    runs = [
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=7)
        for _ in range(2)
    ]
    texts = [[c.text for c in sorted(run.choices, key=lambda c: c.index)] for run in runs]
    assert texts[0] == texts[1] and len(set(texts[0])) > 1
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0]
    stop = full.text.split()[2]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert full.text.startswith(cut.choices[0].text)


def test_32_concurrent_streams_complete(client, reference):
    tokenizer, greedy = reference
    prompts = [f"Question {i}: name a country in {'Europe' if i % 2 else 'Asia'}. Answer:" for i in range(32)]

    def stream(prompt):
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(stream, prompts))
    expected = greedy([tokenizer.encode(p) for p in prompts], 8)
    assert texts == expected


def metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith(name + " ")))


def test_a_disconnect_frees_its_pages(server):
    url = server[1]
    body = {"model": MODEL, "prompt": PROMPT * 8, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(url, "jaxkv_pages_used") > 0
    deadline = time.monotonic() + 30
    while metric(url, "jaxkv_pages_used") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(url, "jaxkv_pages_used") == 0
    assert metric(url, "jaxkv_running_requests") == 0


@pytest.mark.parametrize(
    "body, status, param",
    [
        ("{not json", 400, None),
        ({"model": "gpt-9", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "n": 9}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ({"model": MODEL}, 400, "prompt"),
    ],
    ids=["malformed-json", "unknown-model", "max-tokens-0", "past-context", "n-too-large", "wrong-type",
         "unknown-field", "missing-prompt"],
)  # fmt: skip
def test_bad_requests_get_an_openai_error(server, body, status, param):
    url = server[1]
    content = body if isinstance(body, str) else None
    response = httpx.post(f"{url}/v1/completions", content=content, json=None if content else body,
                          headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param, error
    assert httpx.get(f"{url}/health").status_code == 200


def test_bad_requests_do_not_disturb_a_stream_in_flight(server, client, reference):
    tokenizer, greedy = reference
    url = server[1]
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    for body in ({"model": MODEL, "prompt": "x", "max_tokens": -1}, {"model": MODEL, "prompt": [10**9]}, {"model": 1}):
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 400
    assert "".join(c.choices[0].text for c in stream if c.choices) == greedy([tokenizer.encode(PROMPT)])[0]


def test_the_official_client_raises_on_bad_requests(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)


def test_backpressure_answers_503_with_retry_after(server):
    """More waiting requests than --max-waiting (40) with 8 rows: some get 503 + Retry-After,
    the rest complete."""
    url = server[1]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}

    def post(_):
        return httpx.post(f"{url}/v1/completions", json=body, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        responses = list(pool.map(post, range(64)))
    codes = {r.status_code for r in responses}
    assert codes <= {200, 503} and 200 in codes
    busy = [r for r in responses if r.status_code == 503]
    assert busy and all(r.headers.get("retry-after") and r.json()["error"]["type"] for r in busy)


def test_logprobs_and_top_logprobs(client):
    """Completions ``logprobs=2`` and chat ``logprobs`` with ``top_logprobs=2``: one entry per
    generated token; greedy tokens are their own top alternative."""
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2).choices[0]
    assert len(done.logprobs.tokens) == len(done.logprobs.token_logprobs) == 4
    for token, logprob, top in zip(done.logprobs.tokens, done.logprobs.token_logprobs, done.logprobs.top_logprobs):
        assert logprob <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(logprob) and token in top
    messages = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2).choices[0]  # fmt: skip
    assert len(chat.logprobs.content) == 3
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in chat.logprobs.content)


def test_cache_salt_keeps_tenants_apart(client):
    """A repeated long prompt is served from the prefix cache (``usage.prompt_tokens_details``)
    only for requests with the same ``cache_salt``."""
    prompt = "Tenant data: " + "alpha beta gamma delta " * 20

    def cached(salt):
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                         extra_body={"cache_salt": salt})  # fmt: skip
        return done.usage.prompt_tokens_details.cached_tokens

    first_a, first_b, again_a = cached("tenant-1"), cached("tenant-2"), cached("tenant-1")
    assert first_a == 0 and first_b == 0 and again_a > 0


def test_chat_takes_text_parts_and_max_completion_tokens(client):
    """OpenAI's current chat fields: ``content`` as a list of text parts, ``max_completion_tokens``
    (``max_tokens`` is its deprecated alias); the reply equals the one to the plain form."""
    text = "List three fruits."
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=8,
                                           temperature=0)  # fmt: skip
    parts = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "text",
                                           "text": text}]}], max_completion_tokens=8, temperature=0)  # fmt: skip
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.completion_tokens == plain.usage.completion_tokens == 8


def test_what_guidellm_sends_ignore_eos_and_usage_in_every_chunk(server):
    """guidellm's request: text parts, ``max_completion_tokens``, ``stop: null``, ``ignore_eos``
    and ``stream_options.continuous_usage_stats``: every chunk carries the usage so far, and the
    output runs past the end-of-sequence token the model would stop at."""
    url = server[1]
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
            "max_completion_tokens": 40, "temperature": 0, "stop": None}  # fmt: skip
    short = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 40
    streaming = body | {"ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=streaming, timeout=120) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    counts = [chunk["usage"]["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 40
    assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(chunk["usage"]["prompt_tokens"] == short["usage"]["prompt_tokens"] for chunk in chunks)


def test_sampling_options_this_server_does_not_implement(client):
    """vLLM's ``min_tokens`` and ``repetition_penalty`` (and OpenAI's penalties) are taken at
    their neutral value, which clients send explicitly, and refused otherwise, naming the field."""
    neutral = {"min_tokens": 0, "repetition_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0}
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body=neutral)
    assert done.usage.completion_tokens == 4
    for field, value in {"min_tokens": 2, "repetition_penalty": 1.2}.items():
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={field: value})


def test_sigterm_drains_requests_in_flight(server):
    """Last in this file: SIGTERM mid-stream lets the stream finish, refuses new connections,
    then the server exits with status 0."""
    proc, url = server
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] in ("length", "stop")
    assert proc.wait(timeout=120) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)
