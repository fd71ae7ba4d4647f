"""The layer protocol and the registry: every layer is a ``CacheLayer`` (a small core) with the
capabilities it opts into, the container asks for a capability by the class and names the layer
and the capability it lacks, one registry gives each layer type its builder and storage
classes, and regressions for three layer bugs: padding that reached a product, repeated
rollbacks that overran a ring's budget, and layer indices of NumPy or JAX integer types.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import (
    LAYER_TYPES,
    Cache,
    CacheLayer,
    Capability,
    ChunkedLayer,
    ChunkLimit,
    DepthBudgets,
    DynamicLayer,
    Eviction,
    EvictionSpec,
    Growth,
    HeldTokens,
    HybridLayer,
    LinearAttentionLayer,
    LinearState,
    Overflow,
    QuantizedLayer,
    QuantSpec,
    Refill,
    Rollback,
    RowSelection,
    SlidingWindowLayer,
    StaticLayer,
    attention,
)
from jaxkv.layers.paged import Paging
from jaxkv.memory import formula_table, layer_class, storage_rows
from jaxkv.mla import LatentSpec
from jaxkv.protocol import has
from jaxkv.research.observer import Observer, refill
from tests.oracle import full_attention

WINDOW, HEAD_DIM = 4, 4
SPEC = QuantSpec(nbits=8, q_group_size=HEAD_DIM, residual_length=HEAD_DIM)
LATENT_SPEC = QuantSpec(nbits=8, q_group_size=2, residual_length=0)  # a latent layer's: no residual, G | R + P
LINEAR = {"conv_width": 2, "conv_channels": 3, "state_shapes": ((3,),)}
# kind -> Cache.from_layer_types options
KINDS = {
    "static": {"layer_types": ["full_attention"], "max_length": 8},
    "dynamic": {"layer_types": ["full_attention"], "full_attention": "dynamic"},
    "sliding": {"layer_types": ["sliding_attention"]},
    "chunked": {"layer_types": ["chunked_attention"]},
    "quantized": {"layer_types": ["full_attention"], "max_length": 8, "quantization": SPEC},
    "quantized_sliding": {"layer_types": ["sliding_attention"], "quantization": SPEC},
    "hybrid_sliding": {"layer_types": ["hybrid_sliding"], **LINEAR},
}
RINGS = ("sliding", "chunked", "quantized_sliding")


def make_cache(kind, *, batch=2, rollback_slots=0, **options):
    options = {**KINDS[kind], **options}
    return Cache.from_layer_types(
        options.pop("layer_types"), batch_size=batch, num_kv_heads=1, head_dim=HEAD_DIM, sliding_window=WINDOW,
        attention_chunk_size=WINDOW, rollback_slots=rollback_slots, **options,
    )  # fmt: skip


def tokens(seed, batch, width, heads=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(batch, heads, width, HEAD_DIM)), jnp.float32)


def conv_fn(windows):  # [B, T, C, K] -> the recurrence's input [B, T, C]
    return windows.sum(-1)


def step_fn(states, x):
    (total,) = states
    total = 0.5 * total + x
    return (total,), total


# --- the protocol: a small core and capabilities ----------------------------------------------
CORE = {
    "update", "update_entry", "attend_entry", "entry_view", "store_entry", "unstacked", "reset", "logical_axes",
    "max_length", "nbytes", "describe", "WHY_NOT",
}  # fmt: skip
PAGING = Paging(page_size=4, num_pages=8, max_length=16)
EVICTION = EvictionSpec("h2o", budget=8)
# kind -> Cache.from_layer_types options, for the capability table (every layer class once)
BUILT_KINDS = {
    **KINDS,
    "evicting": {"layer_types": ["full_attention"], "max_length": 8, "eviction": EVICTION},
    "observer": {"layer_types": ["full_attention"], "max_length": 8, "layer_builder": Observer()},
    "linear": {"layer_types": ["linear_attention"], **LINEAR},
    "paged": {"layer_types": ["full_attention"], "paging": PAGING},
    "packed_evicting": {"layer_types": ["full_attention"], "paging": PAGING, "eviction": EVICTION},
    "packed_state": {"layer_types": ["linear_attention"], "paging": PAGING, **LINEAR},
    "latent": {"layer_types": ["latent_attention"], "max_length": 8, "latent": LatentSpec(4, 2)},
    "indexed_dynamic": {
        "layer_types": ["indexed_attention"], "full_attention": "dynamic", "latent": LatentSpec(4, 2, 4, 2),
    },
    "paged_indexed": {"layer_types": ["indexed_attention"], "paging": PAGING, "latent": LatentSpec(4, 2, 4, 2)},
}
# The capabilities each kind's layer has (the others it lacks).
CAPABILITIES = {
    "static": {Rollback, RowSelection, HeldTokens, Refill, Overflow},
    "dynamic": {Rollback, RowSelection, Growth, HeldTokens, Refill, Overflow},
    "sliding": {Rollback, RowSelection, HeldTokens, Refill},
    "chunked": {Rollback, RowSelection, HeldTokens, Refill},
    "quantized": {Rollback, RowSelection, Refill, Overflow, ChunkLimit},
    "quantized_sliding": {Rollback, RowSelection, Refill, Overflow, ChunkLimit},
    "hybrid_sliding": {Rollback, RowSelection, LinearState, Growth, Overflow, ChunkLimit},
    "evicting": {RowSelection, Eviction, DepthBudgets, Refill},
    "observer": {RowSelection, Eviction, HeldTokens, Overflow},
    "linear": {Rollback, RowSelection, LinearState},
    "paged": set(),
    "packed_evicting": {DepthBudgets},
    "packed_state": set(),
    "latent": {Rollback, RowSelection, Overflow},
    "indexed_dynamic": {Rollback, RowSelection, Growth, Overflow},
    "paged_indexed": set(),
}
ALL_CAPABILITIES = (
    Rollback, RowSelection, Growth, Eviction, DepthBudgets, HeldTokens, Refill, LinearState, Overflow, ChunkLimit
)


def built(kind, batch=1):
    options = dict(BUILT_KINDS[kind])
    return Cache.from_layer_types(
        options.pop("layer_types"), batch_size=batch, num_kv_heads=1, head_dim=HEAD_DIM, sliding_window=WINDOW,
        attention_chunk_size=WINDOW, **options,
    )  # fmt: skip


@pytest.mark.parametrize(
    "cls",
    [StaticLayer, DynamicLayer, SlidingWindowLayer, ChunkedLayer, QuantizedLayer, LinearAttentionLayer, HybridLayer],
)
def test_every_layer_is_a_cache_layer(cls):
    assert issubclass(cls, CacheLayer)
    assert not cls.__abstractmethods__


def test_the_core_is_small():
    """What every layer inherits: the core's names and nothing else (capabilities are opted into)."""
    assert {name for name in vars(CacheLayer) if not name.startswith("_")} == CORE
    assert all(issubclass(capability, Capability) for capability in ALL_CAPABILITIES)


@pytest.mark.parametrize("kind", sorted(CAPABILITIES))
def test_each_layer_has_the_capabilities_of_the_table(kind):
    layer = built(kind).groups[0]
    assert {capability for capability in ALL_CAPABILITIES if has(layer, capability)} == CAPABILITIES[kind]
    assert BUILT_KINDS.keys() == CAPABILITIES.keys()


def test_a_state_layer_refuses_kv_and_a_kv_layer_refuses_a_state():
    """A state layer asked for K/V, or a K/V layer asked for a state, raises a TypeError naming the
    layer and the right call, also through the container."""
    linear = LinearAttentionLayer.create(1, 3, 2, rollback_slots=2)
    assert linear.describe() == "R=2"
    with pytest.raises(TypeError, match="LinearAttentionLayer stores no attention K/V.*update_state"):
        linear.update(tokens(0, 1, 1), tokens(0, 1, 1), jnp.zeros((1, 1), jnp.int32))
    cache = make_cache("hybrid_sliding", batch=1, layer_types=["linear_attention", "full_attention"], max_length=8)
    with pytest.raises(TypeError, match="stores no attention K/V"):
        cache.update(0, tokens(0, 1, 1), tokens(0, 1, 1))
    with pytest.raises(
        TypeError, match=r"StaticLayer cannot take update_state \(no LinearState capability\).*Cache.update\)"
    ):
        cache.update_state(1, jnp.zeros((1, 1, 3)), cache.next_positions(1), conv_fn, step_fn)


def test_the_container_serves_layers_without_an_optional_capability():
    """Growth, a chunk limit and overflow are asked of the layers that have them: the others keep
    their capacity, limit no chunk and never overflow."""
    static = make_cache("static", batch=1)
    assert static.grow(64).layer(0).capacity == 8
    assert static.exact_chunk_lengths() is None
    sliding = make_cache("sliding", batch=1)
    np.testing.assert_array_equal(jax.jit(lambda c: c.overflowed)(fed(sliding, 6)[0]), [False])
    assert static.layer(0).describe() == "-"


def test_an_operation_names_the_layer_and_the_capability_it_lacks():
    """Each capability an operation needs, asked of a layer without it: an error naming both (and,
    where the layer says, why), raised from the classes, under jit too."""
    evicting, packed_state, static = built("evicting", batch=2), built("packed_state", batch=2), built("static", 2)
    with pytest.raises(ValueError, match=r"EvictingLayer cannot roll back \(no Rollback capability\): an evicting"):
        evicting.rollback(2)
    assert evicting.max_rollback == 0 and evicting.rollback(0).lengths.tolist() == [0, 0]
    for edit in (lambda c: c.reorder([1, 0]), lambda c: c.select([0]), lambda c: c.repeat(2),
                 lambda c: c.reorder_in_groups(jnp.asarray([[1, 0]]))):  # fmt: skip
        with pytest.raises(TypeError, match=r"PackedStateLayer cannot reorder, select or repeat rows \(no RowSelect"):
            edit(packed_state)
    with pytest.raises(TypeError, match="no RowSelection capability"):
        jax.jit(lambda c: c.reorder(jnp.asarray([1, 0])))(packed_state)
    with pytest.raises(TypeError, match=r"EvictingLayer cannot grow \(no Growth capability\).*full_attention='dyn"):
        make_cache("dynamic", eviction=EVICTION)
    with pytest.raises(ValueError, match=r"StaticLayer cannot be cut to an eviction budget \(no Eviction capab"):
        static.evict(EVICTION)
    with pytest.raises(TypeError, match=r"ObserverLayer cannot be refilled from another cache \(no Refill capab"):
        refill(static, built("observer", batch=2))
    with pytest.raises(TypeError, match=r"QuantizedLayer cannot hand its tokens to another cache \(no HeldTokens"):
        refill(built("quantized", batch=2), static)
    with pytest.raises(TypeError, match=r"PackedStateLayer cannot take update_state \(no LinearState capab.*packed"):
        packed_state.update_state(0, jnp.zeros((2, 1, 3)), packed_state.next_positions(1), conv_fn, step_fn)
    with pytest.raises(TypeError, match=r"StaticLayer cannot take update_state \(no LinearState capability\)"):
        static.update_state(0, jnp.zeros((2, 1, 3)), static.next_positions(1), conv_fn, step_fn)


def test_hybrid_delegates_to_its_attention_half():
    """A hybrid's chunk limit, growth and overflow are its attention half's (quantized: a
    residual limits the chunk; dynamic: it grows)."""
    quantized = make_cache("hybrid_sliding", layer_types=["hybrid"], max_length=8, quantization=SPEC)
    np.testing.assert_array_equal(quantized.exact_chunk_lengths(), [HEAD_DIM, HEAD_DIM])
    dynamic = make_cache("hybrid_sliding", layer_types=["hybrid"], full_attention="dynamic").grow(16)
    assert dynamic.layer(0).attention.capacity == 16
    assert make_cache("hybrid_sliding").exact_chunk_lengths() is None


# --- one registry --------------------------------------------------------------------------
@pytest.mark.parametrize("layer_type", sorted(LAYER_TYPES))
@pytest.mark.parametrize("full_attention", ["static", "dynamic"])
def test_registry_storage_is_what_the_builder_builds(layer_type, full_attention):
    """Each layer type builds an instance of the class its registry entry (and so its byte
    formula) names; a hybrid has no storage row of its own."""
    options = {"max_length": 8, "full_attention": full_attention, "latent": LatentSpec(4, 2, 4, 2), **LINEAR}
    layer = make_cache("static", layer_types=[layer_type], **options).layer(0)
    storage = LAYER_TYPES[layer_type].storage
    if not storage:
        assert isinstance(layer, HybridLayer)
        return
    assert type(layer) is layer_class(layer_type, full_attention)
    assert type(layer) in storage.values()
    quantizable = LAYER_TYPES[layer_type].quantized
    if quantizable is not None:
        latent = {"latent": options["latent"], "quantization": LATENT_SPEC} if layer_type == "latent_attention" else {}
        built = {"quantization": SPEC, **latent}
        quantized = make_cache("static", layer_types=[layer_type], max_length=8, **built).layer(0)
        assert type(quantized) is quantizable


def test_formula_table_lists_every_storage_once_per_row():
    rows = storage_rows()
    table = formula_table().splitlines()[2:]
    assert len(table) == len(rows)
    for (layer_type, _, cls), line in zip(rows, table):
        assert f"`{cls.__name__}`" in line and layer_type in line and cls.MEMORY_FORMULA in line


# --- padding never reaches a product -------------------------------------------------------
def feed_with_padding(cache, keys, values, positions, conv_inputs):
    """Every layer takes the tokens; returns the cache and each real query's outputs."""
    outs = []
    for i, layer_type in enumerate(cache.layer_types):
        if layer_type in ("linear_attention", "hybrid_sliding"):
            cache, state_out = cache.update_state(i, conv_inputs, positions, conv_fn, step_fn)
            outs.append(state_out)
        if layer_type != "linear_attention":
            cache, kv = cache.update(i, keys, values, positions)
            outs.append(attention(jnp.ones((2, 2, positions.shape[1], HEAD_DIM)), kv, positions))
    return cache, outs


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("kind", [*KINDS, "linear"])
def test_nan_padding_never_reaches_a_product(kind, jit):
    """Padding holding NaN (right padding in row 0, left in row 1) gives the real queries
    exactly what zero padding gives, finite, in every layer kind; rings take the long
    update path (T > rollback_slots + 1). Regression: rings returned the raw new K/V, and a
    masked slot's value still entered the weighted sum as 0 * NaN."""
    cache = make_cache("hybrid_sliding", layer_types=["linear_attention"]) if kind == "linear" else make_cache(kind)
    cache = cache.reserve(3)
    positions = jnp.asarray([[0, 1, -1], [-1, 0, 1]])
    padding = (positions < 0)[:, None, :, None]
    keys, values = tokens(1, 2, 3), tokens(2, 2, 3)
    conv_inputs = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, 3)), jnp.float32)
    step = jax.jit(feed_with_padding) if jit else feed_with_padding
    _, with_nan = step(
        cache, jnp.where(padding, jnp.nan, keys), jnp.where(padding, jnp.nan, values), positions,
        jnp.where(padding[:, 0], jnp.nan, conv_inputs),
    )  # fmt: skip
    _, with_zeros = step(cache, jnp.where(padding, 0.0, keys), jnp.where(padding, 0.0, values), positions,
                         jnp.where(padding[:, 0], 0.0, conv_inputs))  # fmt: skip
    for nan_out, zero_out in zip(with_nan, with_zeros):
        assert np.all(np.isfinite(np.asarray(nan_out))), kind
        np.testing.assert_array_equal(nan_out, zero_out)


# --- a ring's rollback budget is shared by repeated rollbacks ------------------------------
def fed(cache, length, seed=4):
    """``cache`` with ``length`` tokens in every row; returns it and the keys fed."""
    keys = tokens(seed, cache.batch_size, length)
    cache, _ = cache.update(0, keys, keys)
    return cache, keys


@pytest.mark.parametrize("kind", RINGS)
def test_repeated_rollbacks_share_a_ring_budget(kind):
    """A ring of W + 0 slots undoes 1 token: eagerly a second rollback without a feed in
    between is an error naming the fix; a feed renews the budget. Under jit the second is
    clamped to nothing, and the next query still sees its whole window. Regression: the second
    rollback went through and the query at position 8 missed position 5."""
    spec = QuantSpec(nbits=8, q_group_size=HEAD_DIM, residual_length=0)  # every token quantized: all in the ring
    cache, keys = fed(make_cache(kind, batch=1, **({"quantization": spec} if kind.startswith("quantized") else {})), 10)
    assert cache.max_rollback == 1
    once = cache.rollback(1)
    with pytest.raises(ValueError, match=r"row 0 can undo only 0 more token.*feed tokens between rollbacks"):
        once.rollback(1)
    with pytest.raises(ValueError, match=r"can undo only 0"):
        once.layer(0).rollback(1)
    refed, _ = once.update(0, keys[:, :, 9:], keys[:, :, 9:])
    np.testing.assert_array_equal(refed.rollback(1).lengths, [9])  # a feed renews the budget
    clamped = jax.jit(lambda c: c.rollback(1).rollback(1))(cache)
    np.testing.assert_array_equal(clamped.lengths, [9])
    query = keys[:, :, 9:]
    _, kv = clamped.update(0, query, query)
    out = attention(query, kv, jnp.asarray([[9]]))
    rule = {"window": WINDOW} if kind != "chunked" else {"chunk": WINDOW}
    want = full_attention(keys[0], keys[0], keys[0], **rule)[:, 9:]
    np.testing.assert_allclose(out[0], want, atol=0.05 if kind.startswith("quantized") else 1e-5)


def test_all_layers_of_a_cache_are_clamped_alike():
    """Under jit every layer of a cache undoes the smallest count any layer allows (here the
    ring's spent budget), so full attention and the ring stay in step."""
    cache = make_cache("static", layer_types=["full_attention", "sliding_attention"], batch=2)
    for i in range(2):
        cache, _ = cache.update(i, tokens(5, 2, 6), tokens(5, 2, 6))
    rolled = jax.jit(lambda c, n: c.rollback(1).rollback(n))(cache, jnp.asarray([1, 0]))
    for layer in rolled.layers:
        np.testing.assert_array_equal(layer.lengths, [5, 5])


def test_a_quantized_ring_counts_its_budget_from_the_store():
    """With a residual, a rollback that stays within tokens the quantized store never held
    spends none of its slots: from length 10 (8 quantized, W + R = 4 slots) the row undoes 3
    tokens one at a time before the store's budget runs out, and the next query sees its
    whole window."""
    cache, keys = fed(make_cache("quantized_sliding", batch=1), 10)
    for _ in range(3):
        cache = cache.rollback(1)
    with pytest.raises(ValueError, match="can undo only 0 more"):
        cache.rollback(1)
    query = keys[:, :, 7:8]
    _, kv = cache.update(0, query, query)
    out = attention(query, kv, jnp.asarray([[7]]))
    seen = keys[0, :, :8]
    want = full_attention(seen, seen, seen, window=WINDOW)[:, 7:]
    np.testing.assert_allclose(out[0], want, atol=0.05)


def test_a_hybrid_budget_is_its_tighter_half():
    """A linear state keeping 3 steps next to a ring of W + 0 slots: the ring binds."""
    hybrid = HybridLayer(
        LinearAttentionLayer.create(1, 3, 2, rollback_slots=3), SlidingWindowLayer.create(1, 1, HEAD_DIM, WINDOW)
    )
    keys = tokens(6, 1, 6)
    hybrid, _ = hybrid.update(keys, keys, jnp.arange(6)[None])
    hybrid, _ = hybrid.update_state(jnp.ones((1, 6, 3)), jnp.arange(6)[None], conv_fn, None)
    np.testing.assert_array_equal(hybrid.rollback_budget, [1])
    with pytest.raises(ValueError, match="HybridLayer.rollback: row 0 can undo only 0 more"):
        hybrid.rollback(1).rollback(1)


# --- layer indices of any integer type -----------------------------------------------------
@pytest.mark.parametrize("to_index", [np.int64, np.int32, jnp.int32, functools.partial(jnp.asarray, dtype=jnp.int32)])
def test_concrete_integer_indices_are_checked_as_ints(to_index):
    """NumPy integers and concrete 0-d JAX arrays are range-checked like Python ints, and a
    valid one routes like the int (regression: out of range, the write was dropped and another
    layer's view returned; in range, an unstacked two-kind cache called it traced)."""
    stacked = make_cache("static", layer_types=["full_attention"] * 2, stacked=True, batch=1)
    with pytest.raises(IndexError, match=r"layer_idx must be an int in \[0, 2\), got 5"):
        stacked.update(to_index(5), tokens(0, 1, 1), tokens(0, 1, 1))
    with pytest.raises(IndexError, match="index 2 out of range: group 0 holds 2 layers"):
        stacked.update((0, to_index(2)), tokens(0, 1, 1), tokens(0, 1, 1))
    mixed = make_cache("static", layer_types=["full_attention", "sliding_attention"], batch=1)
    by_int, view = mixed.update(1, tokens(0, 1, 1), tokens(0, 1, 1))
    by_scalar, scalar_view = mixed.update(to_index(1), tokens(0, 1, 1), tokens(0, 1, 1))
    assert type(by_scalar.layer(1)) is SlidingWindowLayer
    np.testing.assert_array_equal(scalar_view.keys, view.keys)
    np.testing.assert_array_equal(by_scalar.layer(1).lengths, by_int.layer(1).lengths)


def test_non_integer_indices_are_refused():
    cache = make_cache("static", layer_types=["full_attention"] * 2, batch=1)
    with pytest.raises(TypeError, match="layer index must be an integer scalar, got float"):
        cache.update(1.0, tokens(0, 1, 1), tokens(0, 1, 1))
    with pytest.raises(TypeError, match=r"shape \(2,\)"):
        cache.update(np.arange(2), tokens(0, 1, 1), tokens(0, 1, 1))
