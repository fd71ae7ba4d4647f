"""The serving engine on a device mesh (8 host devices: see conftest): the page pools are allocated
sharded (pages over ``data``, K/V heads over ``model``), the compiled step keeps them there and
updates them in place, and the greedy tokens equal ``generate`` on one device for every mesh shape.

The tiny configs have 8 (Llama) and 4 (Gemma 3) K/V heads so that ``model`` shards them; Gemma's 4
heads on a ``model`` axis of 8, and the vocabulary of 61, are replicated (a warning, silenced here).
"""

import re

import jax
import numpy as np
import pytest
from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.llama import Llama, LlamaConfig

from jaxkv.decoding.generate import generate
from jaxkv.eviction import EvictionSpec
from jaxkv.quantization import QuantSpec
from jaxkv.serving import Engine
from jaxkv.sharding import device_bytes, make_mesh
from tests.cases import TINY_GEMMA, TINY_LLAMA, VOCAB, collective_shapes, greedy_reference, run_arrivals, stack_shapes
from tests.serving.test_speculation import SPECULATIVE, Oracle

pytestmark = pytest.mark.filterwarnings("ignore:.*is not divisible by mesh axis:UserWarning")

MESHES = {"1x8": {"data": 1, "model": 8}, "2x4": {"data": 2, "model": 4}, "4x2": {"data": 4, "model": 2},
          "8x1": {"data": 8, "model": 1}}  # fmt: skip
WIDE_HEADS = {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 128}
LLAMA = LlamaConfig(**TINY_LLAMA | WIDE_HEADS)
GEMMA = Gemma3Config(**TINY_GEMMA | {"num_key_value_heads": 4, "sliding_window": 8, "max_position_embeddings": 128})
# kv_memory: about 40 pages of each pool (Llama: 6 KiB pages; Gemma: 1 KiB pages per pool). No
# pool then holds 8 pages on a device: the step's 8 page copies are gathered (an all-reduce over
# ``data``) and would look like a pool to ``assert_pools_stay_put``.
MODELS = {"llama": (Llama, LLAMA, 40 * 6144), "gemma3": (Gemma3, GEMMA, 80 * 1024)}
# Rows divide every data axis; prompts past Gemma's window, chunked over steps.
SMALL = {"page_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 16}
PROMPTS = [np.random.default_rng(n).integers(0, VOCAB, n).tolist() for n in (13, 5, 22, 9)]
ARRIVALS = [0, 0, 2, 3]
NEW_TOKENS = 6
INT8 = QuantSpec(nbits=8, residual_length=0, q_group_size=8)
ALIASED_PARAMETER = re.compile(r"\{[\d,]*\}: \((\d+),")
POOL_PARAMETER = re.compile(r'parameter\((\d+)\).*op_name="cache\.groups\[\d+\]\.(?:key|value)_pages')


def sharded_engine(name: str, mesh_name: str, **options) -> Engine:
    cls, config, kv_memory = MODELS[name]
    return Engine(cls(config, mesh=make_mesh(MESHES[mesh_name])), **{"kv_memory": kv_memory, **SMALL, **options})


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    """Each model's greedy tokens for ``PROMPTS`` on one device."""
    return {name: greedy_reference(cls(config), PROMPTS, NEW_TOKENS) for name, (cls, config, _) in MODELS.items()}


# Each model with K/V heads over ``model`` only (1x8; Gemma's 4 heads replicated there), over both
# axes and pages over ``data`` only (8x1). The mixed meshes 2x4 and 4x2 take the same path (heads over
# ``model``, pages over ``data``): one each model, so that both shapes run.
SERVED = [("llama", "1x8"), ("llama", "4x2"), ("llama", "8x1"), ("gemma3", "1x8"), ("gemma3", "2x4"), ("gemma3", "8x1")]


@pytest.fixture(scope="module", params=SERVED, ids="-".join)
def served(request) -> tuple[str, Engine, list[list[int]]]:
    """A model's engine on a mesh after serving ``PROMPTS`` in staggered arrivals, and their tokens."""
    name, mesh_name = request.param
    engine = sharded_engine(name, mesh_name)
    return name, engine, run_arrivals(engine, PROMPTS, ARRIVALS, NEW_TOKENS)


def pools_of(engine: Engine) -> list:
    """The engine's page pools: each paged group's keys and values (codes and scales when quantized)."""
    return [(group.key_pages, group.value_pages) for group in engine.runner.cache.groups]


def pool_shapes(engine: Engine) -> set[tuple[int, ...]]:
    """Global and per-device shapes of every pool leaf, as a stack and as one layer."""
    return set().union(*(stack_shapes(leaf.shape, leaf.sharding) for leaf in jax.tree.leaves(pools_of(engine))))


def unaliased_pools(text: str) -> set[int]:
    """Parameters of a compiled module holding a pool leaf whose buffer no output reuses."""
    header = text.split("entry_computation_layout", 1)[0]
    aliased = {int(number) for number in ALIASED_PARAMETER.findall(header)}
    pools = {int(number) for number in POOL_PARAMETER.findall(text)}
    assert pools, "no pool parameter found in the compiled step"
    return pools - aliased


def assert_pools_stay_put(engine: Engine) -> None:
    """In every compiled step no collective returns a pool (whole or one device's share) and each
    donated pool is updated in place; after the steps the cache is laid out as it was allocated."""
    assert engine.runner.executables
    shapes = pool_shapes(engine)
    for bucket, executable in engine.runner.executables.items():
        text = executable.as_text()
        moved = [shape for shape in collective_shapes(text) if shape in shapes]
        assert not moved, f"bucket {bucket}: collectives return pools {moved}"
        assert not unaliased_pools(text), f"bucket {bucket}: donated pools not aliased"
    laid_out = jax.tree.map(
        lambda leaf, sharding: leaf.sharding.is_equivalent_to(sharding, leaf.ndim),
        engine.runner.cache,
        engine.runner.cache.shardings(),
    )
    assert all(jax.tree.leaves(laid_out))


def test_greedy_tokens_equal_generate(served, references):
    """Staggered requests, prefill chunked over steps, rows and pages recycled: each request gets
    exactly one-device ``generate``'s greedy tokens, and every page comes back."""
    name, engine, tokens = served
    assert tokens == references[name]
    for pool in engine.kv.pools:
        assert pool.manager.num_free == pool.manager.num_usable


def test_the_step_keeps_the_pools_sharded(served):
    assert_pools_stay_put(served[1])


def test_each_device_holds_its_share_of_the_pools(served):
    """``kv_memory`` is the pools' total over all devices; each pool's pages are a multiple of the
    ``data`` axis, and each device holds the total over the shards: pages over ``data``, K/V
    heads over ``model`` when it divides them (Gemma's 4 heads on 8 are replicated)."""
    name, engine, _ = served
    mesh, sizes = engine.runner.cache.layout.mesh, engine.sizes
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(pools_of(engine)))
    assert total == sizes.full_pages * sizes.full_page_bytes + sizes.sliding_pages * sizes.sliding_page_bytes
    assert total <= MODELS[name][2]
    assert sizes.page_shards == mesh.shape["data"]
    assert sizes.full_pages % mesh.shape["data"] == sizes.sliding_pages % mesh.shape["data"] == 0
    head_shards = mesh.shape["model"] if MODELS[name][1].kv_heads % mesh.shape["model"] == 0 else 1
    share = total // (mesh.shape["data"] * head_shards)
    assert device_bytes(pools_of(engine)) == {device: share for device in mesh.devices.flat}


def test_quantized_pages_on_a_mesh_equal_generate():
    """int8 pages (codes and scales, both sharded) on a 2x4 mesh: the greedy tokens of ``generate``
    with a static cache quantized the same way, and the pools stay put."""
    engine = sharded_engine("llama", "2x4", quantization=INT8)
    tokens = run_arrivals(engine, PROMPTS, ARRIVALS, NEW_TOKENS)
    result = generate(Llama(LLAMA), PROMPTS, max_new_tokens=NEW_TOKENS, stop_tokens=(), quantization=INT8)
    assert tokens == [result.row(i) for i in range(len(PROMPTS))]
    assert_pools_stay_put(engine)


def test_rows_need_not_divide_the_data_axis_without_per_row_slots(references):
    """The block tables are a step's argument, not sharded state: 6 rows on a data axis of 4."""
    engine = sharded_engine("llama", "4x2", max_num_seqs=6)
    assert run_arrivals(engine, PROMPTS, ARRIVALS, NEW_TOKENS) == references["llama"]


def test_per_row_slots_need_rows_that_divide_the_data_axis():
    """Evicted layers keep slots per row, split over ``data``: the error names max_num_seqs."""
    eviction = EvictionSpec("h2o", budget=10, window=4)
    with pytest.raises(ValueError, match=r"max_num_seqs \(6\) must be a multiple of the 4 devices of the mesh axis"):
        sharded_engine("llama", "4x2", max_num_seqs=6, eviction=eviction, prefix_caching=False)


def test_a_pool_too_small_for_the_data_axis_is_an_error():
    """7 pages' worth on a data axis of 8: no pool of a multiple of 8 pages fits."""
    with pytest.raises(ValueError, match=r"at least 8 pages of 6144 bytes \(a multiple of the 8 devices"):
        sharded_engine("llama", "8x1", kv_memory=7 * 6144)


@pytest.mark.parametrize(("name", "mesh_name"), [("llama", "4x2"), ("gemma3", "2x4")])
def test_speculation_on_a_mesh_equals_generate(references, name, mesh_name):
    """Drafts verified on a mesh (an oracle's, each wrong with probability 0.3): the tokens equal
    ``generate`` on one device and the pools stay sharded in place in the verifying steps too."""
    oracle = Oracle({tuple(p): r for p, r in zip(PROMPTS, references[name])}, 0.3)
    engine = sharded_engine(name, mesh_name, speculative=SPECULATIVE)
    engine.speculation.proposer = oracle
    assert run_arrivals(engine, PROMPTS, ARRIVALS, NEW_TOKENS) == references[name]
    assert engine.stats().speculation.accepted > 0
    assert any(width > 1 for _, _, width in engine.runner.executables)
    assert_pools_stay_put(engine)
