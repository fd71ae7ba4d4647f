"""``jaxkv serve`` with speculative decoding (issue 40): the options from flags and the config to
the engine, then a real speculating server (n-gram drafts, SmolLM2-135M, the official ``openai``
client): greedy text equals ``generate``'s (what a plain server returns, ``test_server.py``), the
per-request ``speculation`` counters and ``/metrics``, the ``speculative: false`` opt-out, and
bad values answered 400 naming the field."""

import concurrent.futures

import httpx
import openai
import pytest
from jaxkv.models.llama import Llama, LlamaConfig

from jaxkv.cli.main import build_parser
from jaxkv.cli.serve import resolve_serve_config
from jaxkv.engine_args import with_draft_model
from jaxkv.serving import Engine
from jaxkv.serving.speculation import SpeculativeConfig
from tests.cases import TINY_LLAMA
from tests.server.conftest import MODEL, SERVER_ARGS
from tests.server.test_server import metric, reference  # noqa: F401 - the fixture: generate's greedy text

# Every draft verified, so the counters do not depend on the measured rule's timings.
SERVER_ARGS = (
    *SERVER_ARGS, "--speculative-method", "ngram", "--speculative-num-tokens", "4", "--speculative-always-verify",
)  # fmt: skip
# Text that repeats itself: prompt lookup finds what follows, and greedy SmolLM2 goes on repeating.
COPY = "Repeat the list exactly.\nList: red, green, blue, cyan, magenta, yellow, black, white.\nList: red, green,"
MAX_TOKENS = 24


def resolved(*argv, config=None):
    flags = ["serve", *(["--config", str(config)] if config else []), *argv]
    return resolve_serve_config(build_parser().parse_args(flags))


def test_flags_and_config_reach_the_engine(tmp_path):
    """The YAML section and the flags on top of it make the engine's ``SpeculativeConfig``; off by default."""
    assert resolved().engine.speculative is None
    config = tmp_path / "serve.yaml"
    config.write_text("engine:\n  speculative: {method: ngram, num_tokens: 3, always_verify: true}\n  kv_memory: 1MiB\n")
    served = resolved("--speculative-num-tokens", "5", "--speculative-max-ngram", "6", config=config)
    engine = Engine(Llama(LlamaConfig(**TINY_LLAMA)), served.engine)
    assert engine.config.speculative == SpeculativeConfig("ngram", num_tokens=5, max_ngram=6, always_verify=True)
    assert resolved("--speculative-method", "ngram", "--speculative-min-ngram", "1").engine.speculative.min_ngram == 1
    verify = resolved("--speculative-method", "ngram", "--speculative-always-verify").engine.speculative
    assert verify.always_verify is True


def test_a_draft_model_is_named_and_loaded_by_the_caller():
    """``--speculative-draft-model`` (or its old spelling ``--draft-model``) is a name in the config;
    ``with_draft_model`` replaces it by the model its loader loads."""
    served = resolved("--speculative-method", "draft", "--draft-model", "smollm2", "--kv-memory", "1MiB")
    assert served.engine.speculative.draft_model == "smollm2"
    assert resolved("--speculative-method", "draft", "--speculative-draft-model", "x").engine.speculative.draft_model == "x"
    tiny = Llama(LlamaConfig(**TINY_LLAMA))
    loaded = []
    engine = Engine(tiny, with_draft_model(served.engine, lambda name, mesh=None: loaded.append(name) or (tiny, None)))
    assert loaded == ["smollm2"]
    assert engine.config.speculative.method == "draft" and engine.config.speculative.draft_model is tiny


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--speculative-tokens", "4"], "--speculative-method"),
        (["--draft-model", "smollm2"], "--speculative-method"),
        (["--speculative-method", "medusa"], "method"),
        (["--speculative-method", "ngram", "--speculative-tokens", "0"], "num_tokens"),
        (["--speculative-method", "ngram", "--speculative-tokens", "16"], "num_tokens"),
        (["--speculative-method", "ngram", "--speculative-min-ngram", "5"], "min_ngram"),
        (["--speculative-method", "draft"], "draft_model"),
        (["--speculative-method", "ngram", "--draft-model", "smollm2"], "draft_model"),
    ],
    ids=["tokens-without-method", "draft-without-method", "unknown-method", "no-tokens", "too-many-tokens",
         "min-above-max", "draft-without-model", "model-without-draft"],
)  # fmt: skip
def test_bad_options_name_the_option(argv, named):
    with pytest.raises(ValueError, match=named):
        resolved(*argv)


def test_a_config_typo_in_the_section_is_named(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("engine: {speculative: {method: ngram, num_token: 3}}\n")
    with pytest.raises(ValueError, match="speculative.num_token"):
        resolved(config=config)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[1]}/v1", api_key="unused", max_retries=0, timeout=300)


def complete(client, prompt=COPY, **options):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **options)


def test_greedy_text_equals_generate_with_drafts_accepted(server, client, reference):  # noqa: F811
    """Sequential and concurrent greedy completions (several rows verifying in one step) are
    ``generate``'s text; the response counts the drafts, ``usage`` is OpenAI's as without them."""
    tokenizer, greedy = reference
    prompts = [COPY, COPY.replace("List", "Colours"), "Count: 1 2 3 4 5 6 7 8 1 2 3 4 5 6 7 8 1 2 3", "Say hello."]
    expected = greedy([tokenizer.encode(p) for p in prompts], MAX_TOKENS)
    whole = complete(client)
    assert whole.choices[0].text == expected[0]
    counted = whole.model_extra["speculation"]
    assert counted["proposed"] > 0 and 0 < counted["accepted"] <= counted["proposed"] and counted["steps"] > 0
    assert counted["acceptance_rate"] == pytest.approx(counted["accepted"] / counted["proposed"])
    assert counted["mean_accepted_length"] == pytest.approx(1 + counted["accepted"] / counted["steps"])
    assert whole.usage.completion_tokens == MAX_TOKENS
    assert set(whole.usage.model_dump(exclude_none=True)) == {"prompt_tokens", "completion_tokens", "total_tokens",
                                                              "prompt_tokens_details"}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: complete(client, p).choices[0].text, prompts))
    assert texts == expected


def test_a_stream_carries_the_counters_with_its_usage(client):
    whole = complete(client)
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].model_extra["speculation"] == whole.model_extra["speculation"]  # greedy: the same drafts
    assert all("speculation" not in c.model_extra for c in chunks[:-1])


def test_metrics_count_the_drafts(server, client):
    url = server[1]
    before = metric(url, "jaxkv_speculative_proposed_tokens_total")
    counted = complete(client).model_extra["speculation"]
    proposed = metric(url, "jaxkv_speculative_proposed_tokens_total")
    accepted = metric(url, "jaxkv_speculative_accepted_tokens_total")
    steps = metric(url, "jaxkv_speculative_steps_total")
    assert proposed - before == counted["proposed"] and 0 < accepted <= proposed and steps > 0
    assert metric(url, "jaxkv_speculative_acceptance_rate") == pytest.approx(accepted / proposed)
    assert metric(url, "jaxkv_speculative_mean_accepted_length") == pytest.approx(1 + accepted / steps)


def test_the_opt_out_drafts_nothing_and_returns_the_same_text(server, client):
    url = server[1]
    drafted = complete(client)
    before = metric(url, "jaxkv_speculative_proposed_tokens_total")
    plain = complete(client, extra_body={"speculative": False})
    assert plain.choices[0].text == drafted.choices[0].text
    assert plain.usage.completion_tokens == drafted.usage.completion_tokens
    assert plain.model_extra["speculation"] == {"proposed": 0, "accepted": 0, "steps": 0, "acceptance_rate": 0.0,
                                                "mean_accepted_length": 0.0}  # fmt: skip
    assert metric(url, "jaxkv_speculative_proposed_tokens_total") == before
    messages = [{"role": "user", "content": COPY}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"speculative": False})  # fmt: skip
    assert chat.model_extra["speculation"]["proposed"] == 0


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("value", ["no", 1, None, 0.0])
def test_a_bad_opt_out_is_a_400_naming_the_field(server, path, value):
    body = {"model": MODEL, "max_tokens": 2, "speculative": value}
    body |= {"prompt": "x"} if path == "completions" else {"messages": [{"role": "user", "content": "x"}]}
    response = httpx.post(f"{server[1]}/v1/{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "speculative"
