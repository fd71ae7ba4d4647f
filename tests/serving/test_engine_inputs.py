"""The engine's input processing, output processing and failure isolation on a tiny model:
every bad argument is refused at ``add_request`` with an error naming it (nothing reaches a
step), stop token ids add to the end-of-sequence token, an abort is reported before
``has_unfinished`` turns False, a step that fails fails only its requests, and the text is
decoded incrementally with stop strings held back at a cost bounded by the text."""

import dataclasses
import time

import numpy as np
import pytest
from jaxkv.models.llama import Llama, LlamaConfig

from jaxkv.decoding.sampling import Sampling
from jaxkv.serving import Engine, EngineConfig
from jaxkv.serving.detokenizer import IncrementalDetokenizer, SequenceText
from jaxkv.serving.requests import RequestError
from tests.cases import TINY_LLAMA, VOCAB, greedy_reference

SMALL = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, kv_memory=64 * 1024)
PROMPT = [3, 14, 15, 9, 26, 5]


@pytest.fixture(scope="module")
def llama():
    return Llama(LlamaConfig(**TINY_LLAMA | {"max_position_embeddings": 256, "eos_token_id": 7}))


@pytest.fixture(scope="module")
def engine(llama):
    return Engine(llama, **SMALL)


BAD = {
    "seed -1": (dict(seed=-1), RequestError, "seed"),
    "seed 2**32": (dict(seed=2**32), RequestError, "seed"),
    "seed 2**63": (dict(seed=2**63), RequestError, "seed"),
    "seed float": (dict(seed=1.5), TypeError, "seed"),
    "float token ids": (dict(prompt_ids=[1.7, 2]), TypeError, "prompt_ids"),
    "bool token ids": (dict(prompt_ids=[True, 2]), TypeError, "prompt_ids"),
    "string prompt": (dict(prompt_ids="hello"), TypeError, "prompt_ids"),
    "iterator prompt": (dict(prompt_ids=iter([1, 2])), TypeError, "prompt_ids"),
    "nested prompt": (dict(prompt_ids=np.ones((2, 2), int)), TypeError, "prompt_ids"),
    "token past vocab": (dict(prompt_ids=[VOCAB]), RequestError, "prompt_ids"),
    "cache_salt int": (dict(cache_salt=5), TypeError, "cache_salt"),
    "max_tokens str": (dict(max_tokens="4"), TypeError, "max_tokens"),
    "max_tokens 0": (dict(max_tokens=0), RequestError, "max_tokens"),
    "n 0": (dict(n=0), RequestError, "n"),
    "logprobs -1": (dict(logprobs=-1), RequestError, "logprobs"),
    "stop_token_ids float": (dict(stop_token_ids=[2.5]), TypeError, "stop_token_ids"),
    "stop_token_ids past vocab": (dict(stop_token_ids=[VOCAB + 3]), RequestError, "stop_token_ids"),
    "stop not str": (dict(stop=[3]), TypeError, "stop"),
    "sampling not Sampling": (dict(sampling={"temperature": 1.0}), TypeError, "sampling"),
    "ignore_eos str": (dict(ignore_eos="yes"), TypeError, "ignore_eos"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_arguments_are_refused_naming_the_argument(engine, case):
    kwargs, error, param = BAD[case]
    with pytest.raises(error, match=param) as raised:
        engine.add_request(**{"prompt_ids": PROMPT, "max_tokens": 4} | kwargs)
    assert isinstance(raised.value, RequestError) and raised.value.param == param
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "options",
    [dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")), dict(top_k=2**31),
     dict(top_k=-1), dict(top_k=2.5)],
)  # fmt: skip
def test_sampling_refuses_non_finite_and_out_of_range_values(options):
    with pytest.raises((ValueError, TypeError)):
        Sampling(**options)


# Each EngineConfig field's bad values, every other field at its default (so options that use the
# field, like the page budget for compaction_policy, are unset): each is refused naming the field.
BAD_CONFIG = {
    "kv_memory": ["lots", 0, 1.5],
    "page_size": [0, "16", True],
    "max_num_seqs": [0, 2.0],
    "max_num_batched_tokens": [-16, None],
    "max_model_len": [0, "512"],
    "prefix_caching": ["yes", 1],
    "max_logprobs": [-1, 2.5, None],
    "seed": [-1, "7"],
    "quantization": [{"nbits": 8}, "int8"],
    "eviction": [{"policy": "snapkv"}],
    "host_kv_memory": [-1, "some"],
    "preemption": ["sometimes"],
    "kv_cache_dir": [3, ""],
    "disk_kv_memory": [0, "big", 2.0],
    "speculative": [{"method": "ngram"}],
    "max_pages_per_request": [1, "8"],
    "compaction_policy": ["tova", None],
    "compaction_choice": ["layer"],
    "attention_backend": ["cuda"],
    "pool_layout": ["rows"],
    "retrieval": [{"budget": 64}],
}


def test_every_engine_config_field_has_bad_values_checked():
    assert set(BAD_CONFIG) == {field.name for field in dataclasses.fields(EngineConfig)}


@pytest.mark.parametrize("name,value", [(name, value) for name, values in BAD_CONFIG.items() for value in values])
def test_each_engine_config_field_is_checked_on_its_own(name, value):
    with pytest.raises((TypeError, ValueError), match=name):
        EngineConfig(**{name: value})


def test_the_largest_top_k_and_seed_run(llama, engine):
    """``top_k = 2**31 - 1`` (past the vocabulary: keeps every token) and ``seed = 2**32 - 1`` are
    valid; a request with them runs beside a greedy one, which keeps generate's tokens."""
    greedy = engine.add_request(PROMPT, max_tokens=5, ignore_eos=True)
    engine.add_request(PROMPT, Sampling(temperature=1.0, top_k=2**31 - 1), max_tokens=5, seed=2**32 - 1)
    done = {}
    while engine.has_unfinished():
        for output in engine.step():
            done.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert done[greedy] == greedy_reference(llama, [PROMPT], 5)[0]
    assert all(0 <= t < VOCAB for t in done[greedy + 1])


def test_a_vocabulary_smaller_than_max_logprobs_serves(llama):
    """With the default ``max_logprobs`` (20) and a 12-token vocabulary, a plain engine serves
    greedy requests (they equal ``generate``'s) and one asking for every token's logprob; asking
    for more than the vocabulary is refused naming both numbers."""
    small = Llama(LlamaConfig(**TINY_LLAMA | {"vocab_size": 12, "max_position_embeddings": 256}))
    engine = Engine(small, **SMALL)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    done = engine.generate_many(prompts, max_tokens=6, ignore_eos=True)
    assert [d.finish_reason for d in done] == ["length", "length"]
    assert [d.token_ids for d in done] == greedy_reference(small, prompts, 6)
    (every,) = engine.generate_many([prompts[0]], max_tokens=2, ignore_eos=True, logprobs=12)
    assert every.finish_reason == "length" and all(len(entry["top"]) == 12 for entry in every.logprobs)
    with pytest.raises(RequestError, match=r"logprobs must be in \[0, 12\], got 13"):
        engine.add_request(prompts[0], logprobs=13)


def test_stop_token_ids_add_to_the_end_of_sequence_token(llama):
    """The model's eos (7) still stops a request that passes its own stop ids."""
    expected = greedy_reference(llama, [PROMPT], 30)[0]
    eos = expected[3]
    model = Llama(LlamaConfig(**TINY_LLAMA | {"max_position_embeddings": 256, "eos_token_id": eos}))
    model_engine = Engine(model, **SMALL)
    other = next(t for t in range(VOCAB) if t not in expected)
    done = model_engine.generate_many([PROMPT], max_tokens=30, stop_token_ids=[other])[0]
    assert done.token_ids == expected[: expected.index(eos) + 1] and done.finish_reason == "stop"
    ignored = model_engine.generate_many([PROMPT], max_tokens=30, stop_token_ids=[other], ignore_eos=True)[0]
    assert ignored.token_ids == expected[:30] and ignored.finish_reason == "length"


def test_an_abort_is_reported_before_has_unfinished_turns_false(engine):
    request_id = engine.add_request(PROMPT, max_tokens=8)
    engine.abort(request_id)
    seen = []
    while engine.has_unfinished():
        seen += engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in seen] == [(request_id, True, "abort")]


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(llama, monkeypatch):
    """A failure while a step runs (injected into the model runner) ends the requests of that
    step with finish reason 'error' and the error's message; the next request equals generate."""
    engine = Engine(llama, **SMALL)
    first = engine.add_request(PROMPT, max_tokens=6, ignore_eos=True)
    engine.step()
    run = engine.runner.run

    def broken(*args):
        raise RuntimeError("injected device failure")

    monkeypatch.setattr(engine.runner, "run", broken)
    with pytest.warns(UserWarning, match="injected device failure"):
        outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [(first, "error")]
    assert "injected device failure" in outputs[0].error
    assert not engine.has_unfinished() and engine.kv.usage().pages == 0
    monkeypatch.setattr(engine.runner, "run", run)
    done = engine.generate_many([PROMPT[::-1]], max_tokens=6, ignore_eos=True)[0]
    assert done.token_ids == greedy_reference(llama, [PROMPT[::-1]], 6)[0]


class Pieces:
    """A tokenizer whose tokens decode to fixed byte strings (UTF-8 split across tokens)."""

    PIECES = [b"a", b" b", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"stop", b"!", b" "]

    def decode(self, ids):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


def test_incremental_text_equals_decoding_everything():
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, len(Pieces.PIECES), rng.integers(1, 30)).tolist()
        detokenizer = IncrementalDetokenizer(Pieces())
        text = "".join(detokenizer.append(t) for t in ids) + detokenizer.flush()
        assert text == Pieces().decode(ids)


def test_stop_strings_cut_the_text_and_hold_back_their_prefix():
    text = SequenceText(Pieces(), ["stop!"])
    sent = ""
    for token in [0, 1, 6]:  # "a b" then "stop", which may still become "stop!"
        assert not text.append(token)
        sent += text.delta(finished=False)
    assert sent == "a b"
    assert text.append(7) and text.text == "a b"
    assert sent + text.delta(finished=True) == "a b"


def test_a_huge_stop_string_costs_no_more_than_the_text():
    """A stop string of a million characters: each token's hold-back check stays fast."""
    text = SequenceText(Pieces(), ["a" * 1_000_000, "x" * 999_999 + "y"])
    start = time.perf_counter()
    for _ in range(200):
        text.append(0)
        text.delta(finished=False)
    assert time.perf_counter() - start < 1.0
    assert text.text == "a" * 200 and text.num_sent == 0  # all of it may still become the stop string
