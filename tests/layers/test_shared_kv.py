"""K/V shared across layers (Gemma 4's ``kv_sharing_modes``): a layer that reuses another's K/V
holds no storage and attends over exactly what the storing layer's update returned.

The reference is the same cache without sharing, each reusing layer fed its storing layer's
K/V again: every output equals it through a ragged prefill longer than the window (a ring's
"before the write, then the new tokens" view), decode steps, a rollback and a beam reorder,
eagerly and under jit, with static and dynamic full layers beside sliding rings (window 4, 2
rollback slots). Memory counts each shared cache once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from jaxkv import Cache
from jaxkv.attention import cached_attention
from jaxkv.cache import kv_shapes_of, kv_sources_of
from jaxkv.eviction import EvictionSpec
from jaxkv.memory import cache_bytes

SLIDING, FULL = "sliding_attention", "full_attention"
TYPES = [SLIDING, FULL, SLIDING, FULL, SLIDING, FULL]
SOURCES = (0, 1, 2, 3, 2, 3)  # layers 4 and 5 reuse layers 2 and 3 (transformers' rule, 2 shared layers)
BATCH, HEADS, Q_HEADS, DIM = 2, 2, 4, 8


def build(kv_sources=SOURCES, **options):
    options = dict(batch_size=BATCH, num_kv_heads=HEADS, head_dim=DIM, max_length=32, sliding_window=4,
                   rollback_slots=2) | options  # fmt: skip
    return Cache.from_layer_types(TYPES, kv_sources=kv_sources, **options)


def forward(cache, reference, queries, keys, positions):
    """Every layer attends its ``queries`` [L, B, H_q, T, D] (the reference cache is fed the
    storing layer's ``keys`` [L, B, H_kv, T, D] in the reusing layers); returns both caches and
    both outputs [L, B, H_q, T, D]."""
    outputs, expected = [], []
    for layer, source in enumerate(SOURCES):
        k, v = (None, None) if source != layer else (keys[layer], 2.0 * keys[layer])
        cache, out = cached_attention(cache, layer, queries[layer], k, v, positions)
        k, v = keys[source], 2.0 * keys[source]
        reference, want = cached_attention(reference, layer, queries[layer], k, v, positions)
        outputs.append(out)
        expected.append(want)
    return cache.without_prefetch(), reference, jnp.stack(outputs), jnp.stack(expected)


def feed(step, cache, reference, rng, length, num_new=None):
    positions = cache.next_positions(length, num_new)
    queries = jnp.asarray(rng.normal(size=(len(TYPES), BATCH, Q_HEADS, length, DIM)), jnp.float32)
    keys = jnp.asarray(rng.normal(size=(len(TYPES), BATCH, HEADS, length, DIM)), jnp.float32)
    cache, reference, got, want = step(cache, reference, queries, keys, positions)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert not cache.shared_views  # dropped after the forward: the cache's structure is the one it came in with
    return cache, reference


@pytest.mark.parametrize(
    "options",
    [
        {"full_attention": "static", "jit": True},
        {"full_attention": "dynamic", "jit": False},
        {"full_attention": "static", "stacked": True, "jit": True},
    ],
    ids=["static-jit", "dynamic-eager", "stacked-jit"],
)
def test_reusing_layers_see_what_the_storing_layer_saw(options):
    """Prefill (7 ragged tokens, past the window of 4), decode, roll back 2, reorder the rows
    (beams), decode again: every layer's output equals the unshared reference."""
    options = dict(options)
    step = jax.jit(forward) if options.pop("jit") else forward
    cache, reference = build(**options), build(kv_sources=(), **options)
    rng = np.random.default_rng(0)
    if options["full_attention"] == "dynamic":
        cache, reference = cache.reserve(16), reference.reserve(16)
    cache, reference = feed(step, cache, reference, rng, 7, [7, 5])
    for _ in range(3):
        cache, reference = feed(step, cache, reference, rng, 1)
    cache, reference = cache.rollback(2), reference.rollback(2)
    cache, reference = feed(step, cache, reference, rng, 2)
    rows = jnp.array([1, 1])
    cache, reference = cache.reorder(rows), reference.reorder(rows)
    cache, reference = feed(step, cache, reference, rng, 1)
    assert np.asarray(cache.lengths).tolist() == np.asarray(reference.lengths).tolist() == [9, 9]
    for layer, source in enumerate(SOURCES):  # a reusing layer shows its storing layer's storage
        np.testing.assert_array_equal(cache.layer(layer).keys, reference.layer(source).keys)


def test_memory_counts_each_shared_cache_once():
    """The storage is the storing layers' only: the bytes of a cache of layers 0-3, also by
    ``memory.cache_bytes`` of a config that shares K/V, and the repr says who reuses what."""
    shared = build(stacked=True)
    alone = Cache.from_layer_types(TYPES[:4], batch_size=BATCH, num_kv_heads=HEADS, head_dim=DIM, max_length=32,
                                   sliding_window=4, rollback_slots=2)  # fmt: skip
    assert shared.nbytes == alone.nbytes < build(kv_sources=()).nbytes
    assert shared.stored_layers == (0, 1, 2, 3) and shared.period == 2
    assert [shared.group_layers(g) for g in range(2)] == [[0, 2], [1, 3]]
    assert "reuses layer 2's K/V" in repr(shared) and "reuses layer 3's K/V" in repr(shared)
    config = {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": HEADS, "head_dim": DIM,
              "layer_types": TYPES, "sliding_window": 4, "num_kv_shared_layers": 2}  # fmt: skip
    assert cache_bytes(config, BATCH, 32, jnp.float32, rollback_slots=2) == alone.nbytes


def test_sources_follow_transformers_kv_sharing_modes():
    """``kv_sources_of`` reads transformers' Gemma 4 config (its ``kv_sharing_modes``) and derives
    the same sources from ``num_kv_shared_layers`` alone; per-layer head dims by type."""
    hf = transformers.Gemma4TextConfig(
        num_hidden_layers=7, layer_types=[SLIDING, SLIDING, FULL] * 2 + [FULL], num_kv_shared_layers=3,
        head_dim=16, global_head_dim=32, num_key_value_heads=2,
    )  # fmt: skip
    assert hf.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse", "reuse"]
    as_dict = {"layer_types": hf.layer_types, "num_kv_shared_layers": 3}
    assert kv_sources_of(hf, hf.layer_types) == kv_sources_of(as_dict, hf.layer_types) == (0, 1, 2, 3, 3, 2, 2)
    assert kv_sources_of({"num_kv_shared_layers": 0}, hf.layer_types) == ()
    assert kv_shapes_of(hf, hf.layer_types, 2, 16) == {FULL: (2, 32)}
    assert kv_shapes_of(hf.to_dict(), hf.layer_types, 2, 16) == {FULL: (2, 32)}  # as config.json writes it
    cache = Cache.from_config(hf.to_dict(), 1, max_length=8)
    assert cache.layer(2).keys.shape == (1, 2, 8, 32) and cache.layer(0).keys.shape == (1, 2, hf.sliding_window, 16)
    with pytest.raises(ValueError, match="no earlier full_attention layer stores any"):
        kv_sources_of({"num_kv_shared_layers": 1}, [SLIDING, FULL])


def test_errors_name_the_fix():
    cache = build()
    positions = cache.next_positions(1)
    kv = jnp.zeros((BATCH, HEADS, 1, DIM))
    q = jnp.zeros((BATCH, Q_HEADS, 1, DIM))
    with pytest.raises(ValueError, match="layer 4 reuses layer 2's K/V and stores none"):
        cache.update(4, kv, kv, positions)
    with pytest.raises(ValueError, match="pass keys=None, values=None"):
        cached_attention(cache, 5, q, kv, kv, positions)
    with pytest.raises(ValueError, match="this forward has not computed: run layer 2 first"):
        cached_attention(cache, 4, q, None, None, positions)
    with pytest.raises(TypeError, match="address them by their integer model layer index"):
        build(stacked=True).update((0, jnp.int32(1)), kv, kv, positions)
    with pytest.raises(ValueError, match=r"kv_sources\[3\] = 0: a layer reads its own K/V or those of an earlier"):
        build(kv_sources=(0, 1, 2, 0, 2, 3))
    with pytest.raises(ValueError, match="layers of type linear_attention store their own"):
        Cache.from_layer_types(["linear_attention"] * 2, batch_size=1, num_kv_heads=1, head_dim=4, conv_width=2,
                               conv_channels=4, state_shapes=((1, 4, 4),), kv_sources=(0, 0))  # fmt: skip
    with pytest.raises(ValueError, match="does not combine with K/V shared across layers"):
        build(eviction=EvictionSpec(policy="streaming_llm", budget=8))
    with pytest.raises(ValueError, match="does not combine with kv_sources"):
        build(offload=True)
