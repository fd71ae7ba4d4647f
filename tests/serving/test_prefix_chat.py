"""Prefix reuse, multi-turn chat and cache files: continuing a cache gives exactly what
prefilling the whole text again gives.

* A prefix prefilled once serves many ragged requests, and stays usable afterwards
  (nothing donated or mutated), for full-attention and sliding-window caches.
* A ``Session`` feeds only each turn's new tokens, rolls back to the longest shared prefix
  when the history was re-tokenised differently, and matches a full re-prefill.
* ``save_cache``/``load_cache`` round-trip a cache (in this process and in a fresh one),
  and refuse a file made for another model, other weights or other layer types.
"""

import io
import json
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from jaxkv.cli.main import main
from jaxkv.decoding.generate import generate, prefill_prefix
from jaxkv.decoding.session import Session
from jaxkv.persist import load_cache, save_cache
from jaxkv.quantization import QuantSpec
from jaxkv.models.llama import Llama, LlamaConfig

TINY = {
    "vocab_size": 89, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
}  # fmt: skip
MODELS = {"full": TINY, "sliding-8": TINY | {"sliding_window": 8}}
RNG = np.random.default_rng(0)
PREFIX = RNG.integers(0, TINY["vocab_size"], 37).tolist()
SUFFIXES = [RNG.integers(0, TINY["vocab_size"], n).tolist() for n in (5, 1, 12)]
NEW = 10


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return Llama(LlamaConfig(**MODELS[request.param]), seed=3)


def test_shared_prefix_equals_whole_prompt_and_stays_usable(model):
    prefix_cache = prefill_prefix(model, [PREFIX], max_length=128, rollback_slots=1)
    before = jax.tree.map(np.asarray, prefix_cache)
    shared = generate(model, SUFFIXES, max_new_tokens=NEW, cache=prefix_cache)
    whole = generate(model, [PREFIX + s for s in SUFFIXES], max_new_tokens=NEW, max_length=128, rollback_slots=1)
    for row in range(len(SUFFIXES)):
        assert shared.row(row) == whole.row(row), f"request {row}"
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, prefix_cache), before)  # untouched, still alive
    again = generate(model, SUFFIXES[1:2], max_new_tokens=NEW, cache=prefix_cache)
    assert again.row(0) == whole.row(1)


def test_prefix_that_cannot_fit_is_refused():
    model = Llama(LlamaConfig(**TINY), seed=3)
    prefix_cache = prefill_prefix(model, [PREFIX], max_length=48)
    with pytest.raises(ValueError, match="cannot fit"):
        generate(model, [[1] * 20], max_new_tokens=2, cache=prefix_cache)
    with pytest.raises(ValueError, match="rows"):
        generate(model, SUFFIXES, max_new_tokens=2, cache=prefix_cache.repeat(2))
    with pytest.raises(ValueError, match="not both"):
        generate(model, SUFFIXES, max_new_tokens=2, cache=prefix_cache, max_length=64)


def test_chat_turns_continue_the_cache_and_equal_a_full_prefill(model):
    session = Session(model, max_length=128, rollback_slots=1)
    conversation, reply = [], []
    for turn, user in enumerate([PREFIX[:20], *SUFFIXES]):
        conversation = conversation + reply + user
        result = session.reply(conversation, max_new_tokens=NEW)
        reply = result.row(0)
        fresh = generate(model, [conversation], max_new_tokens=NEW, max_length=128, rollback_slots=1)
        assert reply == fresh.row(0), f"turn {turn}"
        # Turn 0 prefills everything; later turns only the pending last reply token and the user's.
        assert session.fed_tokens == (len(user) if turn == 0 else 1 + len(user))
    # A history whose reply was re-tokenised differently: roll back to where it diverges.
    edited = conversation + reply[:3] + [(reply[3] + 1) % TINY["vocab_size"]] + reply[4:] + SUFFIXES[0]
    result = session.reply(edited, max_new_tokens=NEW)
    assert result.row(0) == generate(model, [edited], max_new_tokens=NEW, max_length=128, rollback_slots=1).row(0)
    budget = session.cache.max_rollback
    assert session.fed_tokens == (len(edited) - len(conversation) - 3 if budget is None else len(edited))


def test_cache_kind_is_a_deprecated_alias_of_full_attention():
    """``cache_kind=`` (the old name) builds what ``full_attention=`` builds, warning at the caller's line."""
    model = Llama(LlamaConfig(**TINY), seed=3)
    with pytest.warns(DeprecationWarning, match="cache_kind= is deprecated.*pass full_attention=") as warned:
        old = generate(model, SUFFIXES, max_new_tokens=NEW, cache_kind="dynamic")
    assert warned[0].filename == __file__
    new = generate(model, SUFFIXES, max_new_tokens=NEW, full_attention="dynamic")
    assert old.tokens.tolist() == new.tokens.tolist() and repr(old.cache) == repr(new.cache)
    with pytest.warns(DeprecationWarning, match="pass full_attention=") as warned:
        session = Session(model, max_length=64, cache_kind="dynamic")
    assert warned[0].filename == __file__
    assert repr(session.cache) == repr(Session(model, max_length=64, full_attention="dynamic").cache)
    with pytest.raises(ValueError, match="pass only full_attention="):
        prefill_prefix(model, [PREFIX], max_length=64, full_attention="static", cache_kind="dynamic")


def test_cache_file_round_trip_in_process(model, tmp_path):
    model = Llama(model.config, dtype=jnp.bfloat16, seed=3)  # bfloat16 storage survives the file
    prefix_cache = prefill_prefix(model, [PREFIX], max_length=128, rollback_slots=1)
    path = tmp_path / "prefix.safetensors"
    save_cache(path, prefix_cache, model, tokens=[PREFIX])
    loaded, tokens = load_cache(path, model)
    assert tokens == [PREFIX]
    assert jax.tree.structure(loaded) == jax.tree.structure(prefix_cache)
    chex.assert_trees_all_equal(loaded, prefix_cache)
    chex.assert_trees_all_equal_dtypes(loaded, prefix_cache)
    assert loaded.layer_types == prefix_cache.layer_types and repr(loaded) == repr(prefix_cache)


def test_quantized_cache_file_round_trip(tmp_path):
    """A static field that is itself a dataclass (the quantization spec) travels too."""
    model = Llama(LlamaConfig(**TINY), seed=3)
    spec = QuantSpec(q_group_size=8, residual_length=16)
    prefix_cache = prefill_prefix(model, [PREFIX], max_length=64, quantization=spec)
    save_cache(tmp_path / "q.safetensors", prefix_cache, model)
    loaded, tokens = load_cache(tmp_path / "q.safetensors", model)
    assert tokens is None and jax.tree.structure(loaded) == jax.tree.structure(prefix_cache)
    chex.assert_trees_all_equal(loaded, prefix_cache)


SUBPROCESS = """
import json, sys
from jaxkv.decoding.generate import generate
from jaxkv.persist import load_cache
from jaxkv.models.llama import Llama, LlamaConfig
config, path, suffixes, new = json.loads(sys.argv[1])
model = Llama(LlamaConfig(**config), seed=3)
cache, tokens = load_cache(path, model)
result = generate(model, suffixes, max_new_tokens=new, cache=cache)
print(json.dumps({"tokens": tokens, "rows": [result.row(i) for i in range(len(suffixes))]}))
"""


def test_cache_file_loads_in_another_process(tmp_path):
    config = MODELS["sliding-8"]  # ring buffers: static fields (window, rollback slots) travel too
    model = Llama(LlamaConfig(**config), seed=3)
    prefix_cache = prefill_prefix(model, [PREFIX], max_length=128, rollback_slots=2)
    path = tmp_path / "prefix.safetensors"
    save_cache(path, prefix_cache, model, tokens=[PREFIX])
    argument = json.dumps([config, str(path), SUFFIXES, NEW])
    done = subprocess.run(
        [sys.executable, "-c", SUBPROCESS, argument], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    expected = generate(model, SUFFIXES, max_new_tokens=NEW, cache=prefix_cache)
    assert out["tokens"] == [PREFIX]
    assert out["rows"] == [expected.row(i) for i in range(len(SUFFIXES))]


def test_loading_for_another_model_names_the_difference(tmp_path):
    model = Llama(LlamaConfig(**TINY), seed=3)
    path = tmp_path / "cache.safetensors"
    save_cache(path, prefill_prefix(model, [PREFIX], max_length=64), model)
    with pytest.raises(ValueError, match="hidden_size: file 32 vs model 64"):
        load_cache(path, Llama(LlamaConfig(**TINY | {"hidden_size": 64}), seed=3))
    with pytest.raises(ValueError, match="other weights"):
        load_cache(path, Llama(LlamaConfig(**TINY), seed=4))

    with safetensors.safe_open(str(path), framework="np") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (a safetensors handle, not a dict)
    forged = tmp_path / "forged.safetensors"
    metadata["jaxkv.layer_types"] = json.dumps(["full_attention", "sliding_attention"])
    safetensors.numpy.save_file(tensors, str(forged), metadata=metadata)
    with pytest.raises(ValueError, match="layer 1: sliding_attention vs full_attention"):
        load_cache(forged, model)

    plain = tmp_path / "plain.safetensors"
    safetensors.numpy.save_file({"x": np.zeros(3, np.float32)}, str(plain))
    with pytest.raises(ValueError, match="not a jaxkv cache file"):
        load_cache(plain, model)
    with pytest.raises(FileNotFoundError):
        load_cache(tmp_path / "missing.safetensors", model)


def test_chat_cli_keeps_the_cache_across_turns_and_files(capsys, monkeypatch, tmp_path):
    """``jaxkv chat`` on SmolLM2: the second turn prefills only its new tokens; the saved
    cache resumes a later session, whose first turn then reuses the shared history."""
    path = tmp_path / "chat.safetensors"
    common = ["chat", "--model", "smollm2", "--max-new-tokens", "6", "--max-length", "256"]
    monkeypatch.setattr("sys.stdin", io.StringIO("Name a colour.\nName another one.\n"))
    assert main([*common, "--system", "Be brief.", "--save-cache", str(path)]) == 0
    out, err = capsys.readouterr()
    assert len([line for line in out.splitlines() if line.strip()]) >= 2, out
    turns = [tuple(map(int, re.search(r"prefilled (\d+) of (\d+)", line).groups())) for line in err.splitlines()
             if line.startswith("[turn")]  # fmt: skip
    assert turns[0][0] == turns[0][1] and turns[1][0] < turns[1][1] - turns[0][1], turns

    monkeypatch.setattr("sys.stdin", io.StringIO("Name a colour.\n"))
    assert main([*common, "--system", "Be brief.", "--load-cache", str(path)]) == 0
    _, err = capsys.readouterr()
    fed, total = map(int, re.search(r"prefilled (\d+) of (\d+)", err).groups())
    assert fed == 1 and total == turns[0][1]  # the whole first turn came from the file's cache
