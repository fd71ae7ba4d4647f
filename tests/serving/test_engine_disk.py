"""The engine's disk tier (``kv_cache_dir``) on tiny models, for each pool kind (full attention,
sliding window, quantized pages): a restarted engine serves a prompt from the pages an earlier
engine left on disk (cached tokens reported, the same tokens), and nothing but the right pages is
ever read: corrupt files, another model's or another format's pages and other salts are refused
or never found, and the engine recomputes with the same tokens."""

import jax
import numpy as np
import pytest
from flax import nnx
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig

from jaxkv import persist
from jaxkv.decoding.generate import prefill_prefix
from jaxkv.persist import load_cache, save_cache, weights_fingerprint
from jaxkv.quantization import QuantSpec
from jaxkv.server.api import Metrics
from jaxkv.serving import Engine, EngineConfig
from tests.cases import TINY_GEMMA, TINY_LLAMA, VOCAB, greedy_reference

MAX_LEN = 128
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
SMALL = {"page_size": 4, "max_num_seqs": 2, "max_num_batched_tokens": 16, "kv_memory": "4MiB"}
OPTIONS = {"max_tokens": 6, "ignore_eos": True}
CASES = {
    "full": ("llama", None),
    "sliding": ("gemma3", None),
    "quantized": ("llama", QuantSpec(nbits=8, residual_length=0, q_group_size=8)),
}
PROMPT = np.random.default_rng(5).integers(0, VOCAB, 27).tolist()  # six full pages of 4, then 3 tokens
CACHED = 24  # the full pages a later request finds (its last token is always computed)


def tiny(kind: str, seed: int = 0):
    if kind == "llama":
        return Llama(LlamaConfig(**TINY_LLAMA | {"max_position_embeddings": MAX_LEN}), seed=seed)
    return Gemma3(Gemma3Config(**TINY_GEMMA | {"sliding_window": 8, "max_position_embeddings": MAX_LEN}), seed=seed)


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    kind, quantization = CASES[request.param]
    return tiny(kind), quantization


def serve(model, directory, quantization=None, salt=None, **options):
    """A fresh engine on ``directory`` serving ``PROMPT``: its completion and the engine."""
    engine = Engine(model, kv_cache_dir=directory, quantization=quantization, **SMALL, **options)
    return engine.generate_many([PROMPT], cache_salt=salt, **OPTIONS)[0], engine


def test_a_restarted_engine_serves_the_prompt_from_disk(case, tmp_path):
    model, quantization = case
    first, engine = serve(model, tmp_path, quantization)
    assert first.num_cached_tokens == 0
    written = engine.stats().disk
    assert written.pages_written == written.pages > 0  # every registered page, once per pool
    again, restarted = serve(model, tmp_path, quantization)
    assert again.num_cached_tokens == CACHED and again.token_ids == first.token_ids
    disk = restarted.stats().disk
    assert disk.hit_pages > 0 and disk.pages_read == disk.hit_pages and disk.pages_written == 0
    restarted.kv.check()


def test_corrupt_files_are_refused_removed_and_recomputed(tmp_path):
    model = tiny("llama")
    first, _ = serve(model, tmp_path)
    files = sorted(tmp_path.rglob("*.kvpage"))
    for i, path in enumerate(files):  # a flipped byte in some, the rest cut short
        data = bytearray(path.read_bytes())
        if i % 2:
            data[-5] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path.write_bytes(bytes(data[: len(data) // 2]))
    again, engine = serve(model, tmp_path)
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids
    assert engine.stats().disk.refused_files >= 1
    assert not any(path.exists() and path.read_bytes() == b"" for path in files)
    third, _ = serve(model, tmp_path)  # the recomputed pages were saved again
    assert third.num_cached_tokens == CACHED and third.token_ids == first.token_ids


def test_another_models_or_formats_pages_are_never_read(tmp_path):
    model = tiny("llama")
    serve(model, tmp_path)
    other, engine = serve(tiny("llama", seed=1), tmp_path)  # other weights, same architecture
    assert other.num_cached_tokens == 0 and engine.stats().disk.pages_read == 0
    quantized, engine = serve(model, tmp_path, QuantSpec(nbits=8, residual_length=0, q_group_size=8))
    assert quantized.num_cached_tokens == 0 and engine.stats().disk.pages_read == 0


def altered(model, name: str, index: int):
    """A copy of ``model`` whose weight ``name`` (its path in the state) differs in one value, the
    ``index``-th of its flattened array."""
    graphdef, state = nnx.split(model)

    def change(path, leaf):
        if jax.tree_util.keystr(path) != name:
            return leaf
        return leaf.reshape(-1).at[index].add(0.5).reshape(leaf.shape)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(change, state))


# One value of the last layer's last weight (the stacked ``wv``'s last), and one value of an
# embedding row past the first 4,096 values (row 50 of 128-wide rows starts at value 6,400).
ALTERATIONS = {"last layer's last weight": ("['layers']['wv'].value", -1), "embedding row 50": ("['embed'].value", 6405)}


@pytest.mark.parametrize("alteration", ALTERATIONS)
def test_a_model_differing_in_one_weight_value_never_shares_a_page_or_a_saved_cache(tmp_path, alteration):
    """The weights' fingerprint covers every byte: a model that differs from another in one value,
    even past the first 4,096 of each weight, finds none of its pages on disk (its tokens are its
    own ``generate``'s) and cannot load its saved cache."""
    model = Llama(LlamaConfig(**TINY_LLAMA | {"max_position_embeddings": MAX_LEN, "hidden_size": 128}))
    other = altered(model, *ALTERATIONS[alteration])
    first_values = [np.asarray(w).reshape(-1)[:4096] for w in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert all(np.array_equal(a, np.asarray(b).reshape(-1)[:4096]) for a, b in
               zip(first_values, jax.tree.leaves(nnx.state(other, nnx.Param))))  # fmt: skip
    serve(model, tmp_path)
    served, engine = serve(other, tmp_path)
    assert served.num_cached_tokens == 0 and engine.stats().disk.pages_read == 0
    assert served.token_ids == greedy_reference(other, [PROMPT], OPTIONS["max_tokens"])[0]
    save_cache(tmp_path / "prefix.safetensors", prefill_prefix(model, [PROMPT], max_length=MAX_LEN), model)
    with pytest.raises(ValueError, match="other weights"):
        load_cache(tmp_path / "prefix.safetensors", other)


def test_a_replaced_weight_changes_the_fingerprint(monkeypatch):
    """A model's fingerprint is hashed once while its weights stay the arrays it was taken of; a
    replaced weight (a fine-tuning step) is hashed again."""
    model = tiny("llama")
    before = weights_fingerprint(model)
    hashed = []
    monkeypatch.setattr(persist, "arrays_digest", lambda named: hashed.append(1) or "rehashed")
    assert weights_fingerprint(model) == before and hashed == []
    model.norm[...] = model.norm[...].at[3].add(1.0)
    assert weights_fingerprint(model) == "rehashed" and hashed == [1]
    nnx.update(model, jax.tree.map(lambda w: 2 * w, nnx.state(model, nnx.Param)))  # an optimizer's update
    assert weights_fingerprint(model) == "rehashed" and hashed == [1, 1]


def test_salts_hold_on_disk(tmp_path):
    model = tiny("llama")
    serve(model, tmp_path, salt="tenant-a")
    other, _ = serve(model, tmp_path, salt="tenant-b")
    unsalted, _ = serve(model, tmp_path)
    same, _ = serve(model, tmp_path, salt="tenant-a")
    assert other.num_cached_tokens == unsalted.num_cached_tokens == 0 and same.num_cached_tokens == CACHED


def test_a_page_already_on_disk_is_not_written_again(tmp_path):
    model = tiny("llama")
    _, engine = serve(model, tmp_path)
    before = engine.stats().disk.pages_written
    # 32 prompt and 5 computed output tokens: 9 full pages, the first 6 shared with PROMPT's, on disk already
    engine.generate_many([PROMPT + [1, 2, 3, 4, 5]], **OPTIONS)
    assert engine.stats().disk.pages_written == before + 3


@pytest.mark.parametrize(
    "options, message",
    [
        ({"kv_cache_dir": "x", "prefix_caching": False}, "kv_cache_dir .* needs prefix_caching"),
        ({"kv_cache_dir": "x", "disk_kv_memory": 0}, "disk_kv_memory must be positive"),
        ({"kv_cache_dir": "x", "disk_kv_memory": "lots"}, "disk_kv_memory"),
    ],
)
def test_bad_disk_options_are_errors_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_warmup_compiles_the_disk_copies_and_serving_compiles_nothing(tmp_path):
    """With a disk tier (and no host tier) ``warmup`` compiles the page reads and writes: saving
    every registered page and reading a prefix back after a restart compile nothing more."""
    model = tiny("llama")
    serve(model, tmp_path)
    engine = Engine(model, kv_cache_dir=tmp_path, **SMALL)
    engine.warmup()
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: compiles.append(event) if event == COMPILE_EVENT else None
    )
    served = engine.generate_many([PROMPT, PROMPT[::-1]], **OPTIONS)
    assert served[0].num_cached_tokens == CACHED and engine.stats().disk.pages_written > 0
    assert compiles == []


def test_disk_options_reach_the_engine_and_its_metrics(tmp_path):
    from jaxkv.cli.main import build_parser
    from jaxkv.cli.serve import resolve_serve_config

    args = build_parser().parse_args(["serve", "--kv-memory", "1MiB", "--kv-cache-dir", str(tmp_path),
                                      "--disk-kv-memory", "1MiB"])  # fmt: skip
    engine = Engine(tiny("llama"), resolve_serve_config(args).engine)
    assert {store.max_bytes for store in engine.kv.tiers.disk.stores.values()} == {2**20}
    engine.generate_many([PROMPT], **OPTIONS)
    rendered = Metrics().render(engine.stats()).decode()
    assert "jaxkv_disk_bytes_written" in rendered and "jaxkv_disk_prefix_hit_pages" in rendered
    assert resolve_serve_config(build_parser().parse_args(["serve"])).engine.kv_cache_dir is None
