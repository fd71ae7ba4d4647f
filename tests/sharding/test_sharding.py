"""Caches and models sharded over a device mesh (8 host devices: see conftest): the same logits and
greedy tokens as on one device for every mesh shape and cache kind, each device holding its share of
the K/V, and compiled loops that keep the cache where it was allocated.

The tiny configs have 8 (Llama) and 4 (Gemma 3) K/V heads so that the ``model`` axis shards them;
the real SmolLM2's 3 K/V heads take the replicated path and shard over ``data``:
test_sharding_smollm2.py (real weights, compiled with full optimization).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cache import Cache
from jaxkv.decoding import driver
from jaxkv.decoding.beam import beam_search
from jaxkv.decoding.generate import generate
from jaxkv.decoding.speculative import PromptLookup, SelfSpeculation, generate_speculative
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.quantization import QuantSpec
from jaxkv import sharding
from jaxkv.sharding import Layout, make_mesh, parse_mesh
from tests.cases import collective_shapes, stack_shapes

VOCAB = 64  # divisible by every model axis: the embedding and head shard too
MESHES = [{"data": 1, "model": 8}, {"data": 2, "model": 4}, {"data": 4, "model": 2}, {"data": 8, "model": 1}]
MESH_IDS = ["1x8", "2x4", "4x2", "8x1"]
LLAMA = LlamaConfig(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=8, max_position_embeddings=256, sliding_window=None,
)  # fmt: skip
GEMMA = Gemma3Config(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=4, head_dim=8, sliding_window=4, query_pre_attn_scalar=8, max_position_embeddings=256,
    layer_types=("sliding_attention", "full_attention"),
)  # fmt: skip
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [1, 2, 3], [40, 41, 42, 43, 44], [7], [9, 9, 9, 9], [3, 1], [50, 2, 8]]
INT8 = QuantSpec(nbits=8, q_group_size=8, residual_length=4)
CACHES = {"static": {}, "quantized": {"quantization": INT8}}
MODELS = {"llama": (Llama, LLAMA), "gemma3": (Gemma3, GEMMA)}
TOKENS = jnp.asarray(np.arange(64).reshape(8, 8) * 7 % VOCAB, jnp.int32)
POSITIONS = jnp.broadcast_to(jnp.arange(8), (8, 8))


def assert_sharded_as(tree, shardings) -> None:
    """Every array leaf of ``tree`` is laid out as the matching ``NamedSharding`` says."""

    def check(path, leaf, sharding):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (
            f"{jax.tree_util.keystr(path)}: {leaf.sharding.spec}, expected {sharding.spec}"
        )

    jax.tree_util.tree_map_with_path(check, tree, shardings)


@pytest.fixture(scope="module")
def unsharded():
    return {name: cls(config, seed=3) for name, (cls, config) in MODELS.items()}


@pytest.fixture(scope="module")
def one_device(unsharded):
    """``(model name, cache kind) -> (logits, greedy tokens)`` on one device, computed once for every mesh."""

    @functools.cache
    def outputs(name: str, kind: str):
        reference, settings = unsharded[name], CACHES[kind]
        logits, _ = reference(TOKENS, POSITIONS, reference.init_cache(8, 32, **settings))
        return np.asarray(logits), generate(reference, PROMPTS, max_new_tokens=6, **settings).tokens

    return outputs


def sharded(name: str, mesh_shape: dict):
    cls, config = MODELS[name]
    return cls(config, seed=3, mesh=make_mesh(mesh_shape))


# Each model on each partitioning: K/V heads over ``model`` only (1x8; Gemma's 4 heads replicated
# there), over both axes, rows over ``data`` only (8x1). The mixed meshes 2x4 and 4x2 take the same
# path (heads over ``model`` and rows over ``data``, both dividing): one each model, so that both
# shapes run; test_each_device_holds_its_share_of_the_kv lays the cache out on every mesh.
MODEL_MESHES = [("llama", "1x8"), ("llama", "4x2"), ("llama", "8x1"), ("gemma3", "1x8"), ("gemma3", "2x4"),
                ("gemma3", "8x1")]  # fmt: skip


@pytest.mark.parametrize("model_name, mesh_id", MODEL_MESHES, ids=["-".join(pair) for pair in MODEL_MESHES])
def test_sharded_models_equal_one_device(one_device, model_name, mesh_id):
    """Logits within 1e-5 and equal greedy tokens, for static and quantized caches (Gemma 3's
    sliding layers are rings; Llama's full), with the cache sharded as the rules say."""
    mesh_shape = MESHES[MESH_IDS.index(mesh_id)]
    model = sharded(model_name, mesh_shape)
    for kind, settings in CACHES.items():
        want, expected_tokens = one_device(model_name, kind)
        got, cache = model(TOKENS, POSITIONS, model.init_cache(8, 32, **settings))
        # A sharded matmul may sum in another order (1 ulp); a quantized cache can round such a K/V value
        # to the neighbouring code, one step of int8 at most: 1e-4 there, 1e-5 in full precision.
        atol = 1e-4 if "quantization" in settings else 1e-5
        np.testing.assert_allclose(np.asarray(got), want, atol=atol, rtol=0, err_msg=kind)
        assert_sharded_as(cache, cache.shardings())
        result = generate(model, PROMPTS, max_new_tokens=6, **settings)
        np.testing.assert_array_equal(result.tokens, expected_tokens, err_msg=kind)
        assert_sharded_as(result.cache, result.cache.shardings())


def test_kv_heads_and_batch_go_where_the_rules_say():
    cache = Cache.from_config(LLAMA, 8, max_length=16, stacked=True, mesh=make_mesh({"data": 2, "model": 4}))
    keys = cache.groups[0].keys  # [L, B, H_kv, S, D]
    assert keys.sharding.spec == jax.sharding.PartitionSpec(None, "data", "model", None, None)
    assert cache.groups[0].lengths.sharding.spec == jax.sharding.PartitionSpec(None, "data")
    model = sharded("llama", {"data": 2, "model": 4})
    # Matrices are stored [out, in]: wq's output heads and w_down's input (the MLP) on model.
    assert model.layers["wq"][...].sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert model.layers["w_down"][...].sharding.spec == jax.sharding.PartitionSpec(None, None, "model")


@pytest.mark.parametrize("mesh_shape", MESHES, ids=MESH_IDS)
@pytest.mark.parametrize("settings", [{}, {"quantization": INT8}], ids=["static", "quantized"])
def test_each_device_holds_its_share_of_the_kv(mesh_shape, settings):
    """Per-device bytes (from ``addressable_shards``) == each leaf's bytes / the shards holding it:
    K/V over data x model, lengths and slot positions over data only."""
    cache = Cache.from_config(GEMMA, 8, max_length=32, stacked=True, mesh=make_mesh(mesh_shape), **settings)
    data, model = mesh_shape["data"], mesh_shape["model"]
    head_shards = model if GEMMA.num_key_value_heads % model == 0 else 1  # 4 K/V heads: replicated over 8
    expected = 0
    for leaf in jax.tree.leaves(cache):
        per_row_only = leaf.ndim <= 3  # lengths [L, B], slot positions [L, B, S]
        expected += leaf.nbytes // (data if per_row_only else data * head_shards)
    held = cache.device_bytes()
    assert len(held) == 8 and set(held.values()) == {expected}


def test_undividable_kv_heads_are_replicated_with_one_warning(monkeypatch):
    """2 K/V heads on a model axis of 4: replicated, said once however many caches and updates follow."""
    monkeypatch.setattr(sharding, "_WARNED", set())
    config = LLAMA.model_copy(update={"num_key_value_heads": 2})
    mesh = make_mesh({"data": 2, "model": 4})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            cache = Cache.from_config(config, 8, max_length=16, stacked=True, mesh=mesh)
            cache, _ = cache.update(0, jnp.ones((8, 2, 3, 8)), jnp.ones((8, 2, 3, 8)))
    messages = [str(w.message) for w in caught]
    assert messages == ["kv_heads (2) is not divisible by mesh axis 'model' of size 4: it is replicated on every "
                        "'model' device"]  # fmt: skip
    assert cache.groups[0].keys.sharding.spec == jax.sharding.PartitionSpec(None, "data", None, None, None)


def test_mesh_errors_name_the_axis_and_sizes():
    with pytest.raises(ValueError, match=r"mesh data=2, model=2 has 4 devices but 8 are available"):
        make_mesh({"data": 2, "model": 2})
    with pytest.raises(ValueError, match=r"batch \(6\) is not divisible by mesh axis 'data' of size 4"):
        Cache.from_config(LLAMA, 6, max_length=16, stacked=True, mesh=make_mesh({"data": 4, "model": 2}))
    with pytest.raises(ValueError, match=r"unknown logical axes \['kv_head'\]"):
        Layout.create(make_mesh({"data": 2, "model": 4}), {"kv_head": "model"})
    with pytest.raises(ValueError, match=r"mesh axes \['tensor'\] that the mesh lacks"):
        Layout.create(make_mesh({"data": 2, "model": 4}), {"kv_heads": "tensor"})
    with pytest.raises(ValueError, match="expected comma-separated axis=size"):
        parse_mesh("data:2")
    assert parse_mesh("data=2, model=4") == {"data": 2, "model": 4}


def test_reorder_and_rollback_keep_the_sharding():
    """A beam reorder and a speculative rollback, eagerly and under jit, leave every leaf sharded as allocated."""
    model = sharded("gemma3", {"data": 2, "model": 4})
    cache = model.init_cache(8, 32, rollback_slots=3)
    tokens = jnp.ones((8, 5), jnp.int32)
    _, cache = model(tokens, jnp.broadcast_to(jnp.arange(5), (8, 5)), cache)
    shardings = cache.shardings()
    beams = jnp.asarray([1, 0, 3, 2, 5, 4, 7, 6])
    for edited in (cache.reorder(beams), jax.jit(Cache.reorder)(cache, beams), cache.rollback(2),
                   jax.jit(Cache.rollback)(cache, jnp.full((8,), 2))):  # fmt: skip
        assert_sharded_as(edited, shardings)
    np.testing.assert_array_equal(np.asarray(cache.rollback(2).lengths), np.full(8, 3))


def cache_leaf_shapes(cache: Cache) -> set[tuple[int, ...]]:
    """Global and per-device shapes of every leaf of ``cache`` and of its repeat to two beams per
    row (beam search repeats its prompts' cache), as whole stacks and single layers."""
    shapes = set()
    for variant in (cache, jax.eval_shape(lambda c: c.repeat(2), cache)):
        for leaf, leaf_sharding in zip(jax.tree.leaves(variant), jax.tree.leaves(cache.shardings())):
            shapes |= stack_shapes(leaf.shape, leaf_sharding)
    return {shape for shape in shapes if np.prod(shape) > 64}  # small bookkeeping (lengths) may move


@pytest.fixture
def compiled_runs(monkeypatch):
    """``(executable, cache leaf shapes)`` of every step a decoding run compiles, recorded at the driver."""
    runs, compile_step = [], driver.compiled

    def recording(fn, static, *args):
        executable, seconds = compile_step(fn, static, *args)
        caches = [arg for arg in args if isinstance(arg, Cache)]
        runs.append((executable, set().union(*map(cache_leaf_shapes, caches))))
        return executable, seconds

    monkeypatch.setattr(driver, "compiled", recording)
    return runs


STRATEGIES = {  # name: (run, whether its loop takes the prefilled cache donated)
    "generate": (lambda model: generate(model, PROMPTS, max_new_tokens=5), True),
    "beam_search": (lambda model: beam_search(model, PROMPTS[:4], num_beams=2, max_new_tokens=5), False),
    "prompt_lookup": (
        lambda model: generate_speculative(model, PROMPTS, drafter=PromptLookup(), max_new_tokens=5),
        True,
    ),
    "self_speculation": (
        lambda model: generate_speculative(model, PROMPTS, drafter=SelfSpeculation(exit_layer=1), max_new_tokens=5),
        True,
    ),
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_compiled_loops_never_move_a_cache_leaf(name, compiled_runs):
    """Prefill and the decode / beam / speculative loops on a 2x4 mesh: no collective returns a cache
    leaf (global, or one device's share; beam search's reorder stays within each prompt's beams), and
    the cache donated to a loop aliases its output (beam search grows it to its beams instead)."""
    strategy, donates = STRATEGIES[name]
    model = sharded("llama", {"data": 2, "model": 4})
    driver._COMPILED.clear()  # compile afresh, so that every step is recorded
    strategy(model)
    assert len(compiled_runs) >= 2
    for executable, leaf_shapes in compiled_runs:
        moved = [shape for shape in collective_shapes(executable.as_text()) if shape in leaf_shapes]
        assert not moved, f"cache leaves moved by collectives: {moved}"
    aliased = [executable.memory_analysis().alias_size_in_bytes for executable, _ in compiled_runs]
    assert aliased[0] > 0 and (aliased[-1] > 0) == donates
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would fail here
        strategy(model)
