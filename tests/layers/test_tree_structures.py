"""Every pytree class jaxkv jits has a tree structure of its own.

``jax.jit`` looks its executables up by the arguments' tree structures. Two classes whose
structures compare equal (``flax.struct.dataclass`` nodes of equal field names and static
values did: ``ChunkedLayer`` and ``SlidingWindowLayer``, ``StaticLayer`` and ``DynamicLayer``)
could be handed each other's executable, and a sliding ring was once masked as a chunk. So:
over every pair of pytree classes of ``jaxkv`` and ``models`` (layers, views, carries, specs),
and over every pair of layer classes the registry builds with equal shapes, structures differ.
"""

import dataclasses
import importlib
import itertools
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
import models
from jaxkv import Cache, CacheLayer, ChunkedLayer, EvictionSpec, MaskInfo, QuantSpec, SlidingWindowLayer
from jaxkv.layers.paged import Paging
from jaxkv.retrieval import RetrievalSpec
from jaxkv.mla import LatentSpec
from jaxkv.research.observer import Observer
from jaxkv.research.recall import QueryRecorder

SPAN, HEAD_DIM = 4, 4
LINEAR = {"conv_width": 2, "conv_channels": 3, "state_shapes": ((3,),)}
PAGING = Paging(page_size=4, num_pages=8, max_length=16)
LATENT = {"latent": LatentSpec(rank=2, rope_dim=2, index_dim=HEAD_DIM, index_topk=4)}
LATENT_QUANTIZATION = QuantSpec(nbits=8, q_group_size=2, residual_length=0)
# One layer type and its options -> the layer class it builds (every registered class once).
BUILDS = {
    "static": (["full_attention"], {}),
    "dynamic": (["full_attention"], {"full_attention": "dynamic"}),
    "sliding": (["sliding_attention"], {}),
    "chunked": (["chunked_attention"], {}),
    "quantized": (["full_attention"], {"quantization": QuantSpec(nbits=8, q_group_size=4, residual_length=4)}),
    "evicting": (["full_attention"], {"eviction": EvictionSpec("h2o", budget=8)}),
    "observer": (["full_attention"], {"layer_builder": Observer()}),
    "paged": (["full_attention"], {"paging": PAGING}),
    "packed_evicting": (["full_attention"], {"paging": PAGING, "eviction": EvictionSpec("h2o", budget=8)}),
    "linear": (["linear_attention"], LINEAR),
    "packed_state": (["linear_attention"], {"paging": PAGING, **LINEAR}),
    "hybrid": (["hybrid"], LINEAR),
    "query_recorder": (["full_attention"], {"layer_builder": QueryRecorder(num_query_heads=1)}),
    "retrieval": (["full_attention"], {"retrieval": RetrievalSpec(budget=8, page_size=4)}),
    "clustered_retrieval": (["full_attention"], {"retrieval": RetrievalSpec(budget=8, page_size=4, pages="clustered")}),
    "latent": (["latent_attention"], LATENT),
    "dynamic_latent": (["latent_attention"], {**LATENT, "full_attention": "dynamic"}),
    "paged_latent": (["latent_attention"], {**LATENT, "paging": PAGING}),
    "quantized_latent": (["latent_attention"], {**LATENT, "quantization": LATENT_QUANTIZATION}),
    "indexed": (["indexed_attention"], LATENT),
    "dynamic_indexed": (["indexed_attention"], {**LATENT, "full_attention": "dynamic"}),
    "paged_indexed": (["indexed_attention"], {**LATENT, "paging": PAGING}),
}


def library_modules():
    """Every module of the ``jaxkv`` and ``models`` packages (a ``__main__`` runs a command: left out)."""
    for package in (jaxkv, models):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not info.name.endswith(".__main__"):
                yield importlib.import_module(info.name)


def skeleton(cls: type):
    """An instance of dataclass ``cls`` with every field None: two classes' skeletons differ
    only by the class, the worst case for telling their structures apart."""
    node = object.__new__(cls)
    for field in dataclasses.fields(cls):
        object.__setattr__(node, field.name, None)
    return node


def pytree_classes() -> list[type]:
    """The dataclasses defined in the library that are registered pytree nodes."""
    found = {}
    for module in library_modules():
        for cls in vars(module).values():
            defined_here = isinstance(cls, type) and cls.__module__ == module.__name__
            if defined_here and dataclasses.is_dataclass(cls):
                if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(skeleton(cls))):
                    found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[name] for name in sorted(found)]


PYTREE_CLASSES = pytree_classes()


def test_the_walk_finds_layers_views_carries_and_the_container():
    names = {cls.__name__ for cls in PYTREE_CLASSES}
    expected = {"SlidingWindowLayer", "ChunkedLayer", "KVView", "MaskInfo", "PagedKVView", "DecodeCarry", "Cache"}
    assert expected <= names, expected - names


@pytest.mark.parametrize(
    "first, second",
    list(itertools.combinations(PYTREE_CLASSES, 2)),
    ids=lambda cls: cls.__qualname__,
)
def test_two_classes_with_equal_fields_have_different_structures(first, second):
    """Every field of both holds None: only the class can tell the structures apart."""
    structures = jax.tree_util.tree_structure(skeleton(first)), jax.tree_util.tree_structure(skeleton(second))
    assert structures[0] != structures[1], f"{first.__qualname__} and {second.__qualname__} share a tree structure"


def built_layer(kind: str) -> CacheLayer:
    """The single group of a one-layer cache of ``kind``, every shape the same for all kinds."""
    layer_types, options = BUILDS[kind]
    cache = Cache.from_layer_types(
        layer_types, batch_size=2, num_kv_heads=1, head_dim=HEAD_DIM, max_length=16, sliding_window=SPAN,
        attention_chunk_size=SPAN, **options,
    )  # fmt: skip
    return cache.groups[0]


BUILT = {kind: built_layer(kind) for kind in BUILDS}


def test_the_registry_builds_every_layer_class():
    """Each registered layer class that is no other's base is among the builds above (a base the
    registry builds too, such as ``StaticLayer``, may be)."""
    layer_classes = [cls for cls in PYTREE_CLASSES if issubclass(cls, CacheLayer)]
    leaves = {
        cls for cls in layer_classes if not any(other is not cls and issubclass(other, cls) for other in layer_classes)
    }
    built = {type(layer) for layer in BUILT.values()}
    assert leaves <= built <= set(layer_classes), leaves - built


@pytest.mark.parametrize("first, second", list(itertools.combinations(BUILDS, 2)))
def test_layers_built_with_equal_shapes_have_different_structures(first, second):
    one, other = BUILT[first], BUILT[second]
    if type(one) is type(other):  # the same class, other options (none today)
        pytest.fail(f"{first} and {second} build the same class; give each class one build")
    assert jax.tree_util.tree_structure(one) != jax.tree_util.tree_structure(other)


def test_a_chunked_and_a_sliding_ring_do_not_mix():
    """Equal shapes, equal static values: still two structures, so trees of the two never combine."""
    chunked, sliding = ChunkedLayer.create(1, 1, 1, SPAN), SlidingWindowLayer.create(1, 1, 1, SPAN)
    assert jax.tree_util.tree_structure(chunked) != jax.tree_util.tree_structure(sliding)
    with pytest.raises(ValueError, match="different types"):
        jax.tree.map(lambda a, b: a, chunked, sliding)


def test_a_jitted_update_gives_a_chunked_and_a_sliding_ring_their_own_masks():
    """The regression: one jitted function, a chunked ring first, then a sliding ring of equal
    shapes; the sliding ring's view once came back with the chunk's mask."""

    @jax.jit
    def mask_of(layer, keys, positions) -> MaskInfo:
        return layer.update(keys, keys, positions)[1].mask_info

    keys = jnp.asarray(np.random.default_rng(0).normal(size=(2, 1, 1, HEAD_DIM)), jnp.float32)
    positions = jnp.zeros((2, 1), jnp.int32)
    chunked = mask_of(ChunkedLayer.create(2, 1, HEAD_DIM, SPAN), keys, positions)
    sliding = mask_of(SlidingWindowLayer.create(2, 1, HEAD_DIM, SPAN), keys, positions)
    assert (chunked.window, chunked.chunk) == (None, SPAN)
    assert (sliding.window, sliding.chunk) == (SPAN, None)
    assert mask_of._cache_size() == 2  # one executable each
