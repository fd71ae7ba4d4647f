"""The container: the "The container" section of the checklist
(shared/reference/cache-behaviours.md).

Construction from model configs, per-row lengths, batch edits (reorder / select /
repeat), rollback, reset, prefix reuse, static overflow, donation, footprint, repr and
input errors. Small float32 shapes; a "token" is random K/V, and padding or rolled-back
tokens carry large values so that any leak shows in the attention outputs.
"""

import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from jaxkv import (
    Cache,
    ChunkedLayer,
    DynamicLayer,
    Overflow,
    SlidingWindowLayer,
    StaticLayer,
    attention,
    attention_mask,
    cache_bytes,
    layer_bytes,
)
from jaxkv.protocol import has

ALL_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# kind -> (layer_types, full_attention)
KIND = {
    "static": (["full_attention"], "static"),
    "dynamic": (["full_attention"], "dynamic"),
    "sliding": (["sliding_attention"], "static"),
    "chunked": (["chunked_attention"], "static"),
}
WINDOW = CHUNK = 4

# One compile per shape instead of one per primitive keeps the file fast. Eager
# behaviour (checks, growth) lives in the cache updates, which stay eager where tested.
mask_of = jax.jit(attention_mask)
attend = jax.jit(attention)


# --- helpers -------------------------------------------------------------------------
def make_cache(layer_types=ALL_TYPES, *, batch=3, heads=1, head_dim=2, max_length=16, rollback_slots=2,
               full_attention="static", dtype=jnp.float32):  # fmt: skip
    return Cache.from_layer_types(
        list(layer_types), batch_size=batch, num_kv_heads=heads, head_dim=head_dim, dtype=dtype,
        max_length=max_length, sliding_window=WINDOW, attention_chunk_size=CHUNK,
        full_attention=full_attention, rollback_slots=rollback_slots,
    )  # fmt: skip


def make_kind(kind, **kwargs):
    layer_types, full = KIND[kind]
    return make_cache(layer_types, full_attention=full, **kwargs)


def feed(cache, q, k, v, positions):
    """Every layer takes the same tokens; returns the cache, each layer's view and output."""
    views, outs = [], []
    for i in range(len(cache.layers)):
        cache, view = cache.update(i, k, v, positions)
        views.append(view)
        outs.append(attend(q, view, positions))
    return cache, views, outs


feed_jit = jax.jit(feed)  # for setup steps; dynamic layers need ``reserve`` first


def rand_tokens(rng, batch, width, heads=1, head_dim=2, scale=1.0):
    """Random (q, k, v) for ``width`` new tokens: q has two heads per K/V head (GQA)."""
    q = rng.normal(size=(batch, 2 * heads, width, head_dim)) * scale
    k = rng.normal(size=(batch, heads, width, head_dim)) * scale
    v = rng.normal(size=(batch, heads, width, head_dim)) * scale
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def ragged_prefill(cache, rng, counts, width=6):
    """Prefill row b with ``counts[b]`` tokens (right padding carries large garbage)."""
    q, k, v = rand_tokens(rng, cache.batch_size, width, scale=100.0)
    positions = cache.next_positions(width, num_new=jnp.asarray(counts))
    cache, _, _ = feed_jit(cache.reserve(width), q, k, v, positions)
    return cache


def admitted(view, positions):
    """Per row and query: the sorted (position, key, value) triples the mask admits."""
    mask = np.asarray(mask_of(positions, view.mask_info))
    kvp = np.asarray(view.mask_info.kv_positions)
    keys, values = np.asarray(view.keys), np.asarray(view.values)
    return [
        [
            sorted(
                (int(kvp[b, s]), keys[b, :, s].tobytes(), values[b, :, s].tobytes()) for s in np.nonzero(mask[b, t])[0]
            )
            for t in range(mask.shape[1])
        ]
        for b in range(mask.shape[0])
    ]


def visible(layer, row):
    """{position: (key bytes, value bytes)} a layer stores visibly for ``row``."""
    keys, values = np.asarray(layer.keys)[row], np.asarray(layer.values)[row]
    length = int(layer.lengths[row])
    if hasattr(layer, "slot_positions"):
        slots = [(int(p), s) for s, p in enumerate(np.asarray(layer.slot_positions)[row]) if 0 <= p < length]
    else:
        slots = [(p, p) for p in range(length)]
    return {p: (keys[:, s].tobytes(), values[:, s].tobytes()) for p, s in slots}


def kv_bytes(cache):
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


# --- construction ----------------------------------------------------------------------
GEMMA3_LIKE = {
    "num_hidden_layers": 12,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "hidden_size": 1024,  # hidden / heads = 128, but head_dim says 16: head_dim wins
    "head_dim": 16,
    "sliding_window": 8,
}


def test_from_config_with_layer_types_gemma3_like():
    """5 sliding : 1 full, from a dict or an attribute-style config: each index gets its
    own layer class, window and head layout."""
    for config in (GEMMA3_LIKE, types.SimpleNamespace(**GEMMA3_LIKE)):
        cache = Cache.from_config(config, batch_size=2, max_length=32)
        assert cache.layer_types == tuple(GEMMA3_LIKE["layer_types"])
        assert len(cache.layers) == 12
        for i, layer in enumerate(cache.layers):
            if i % 6 == 5:
                assert type(layer) is StaticLayer
                chex.assert_shape(layer.keys, (2, 4, 32, 16))
            else:
                assert type(layer) is SlidingWindowLayer and layer.window == 8
                chex.assert_shape(layer.keys, (2, 4, 8, 16))
        assert cache.max_length == 32
        np.testing.assert_array_equal(cache.lengths, [0, 0])


def test_from_config_infers_layer_types_and_head_dim():
    """Without layer_types: a sliding window in use (Mistral) -> all sliding; none (Llama),
    or ``use_sliding_window=False`` (Qwen2) -> all full. head_dim = hidden / heads and K/V
    heads default to the attention heads."""
    mistral = {
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 32,
        "sliding_window": 4,
    }
    cache = Cache.from_config(mistral, batch_size=1)
    assert cache.layer_types == ("sliding_attention",) * 3
    for layer in cache.layers:
        assert type(layer) is SlidingWindowLayer and layer.window == 4
        chex.assert_shape(layer.keys, (1, 2, 4, 8))
    assert cache.max_length is None

    qwen2 = dict(mistral, use_sliding_window=False)
    cache = Cache.from_config(qwen2, batch_size=1, max_length=8)
    assert cache.layer_types == ("full_attention",) * 3

    cache = Cache.from_config(dict(mistral, sliding_window=None), batch_size=1, max_length=8)  # Mistral v0.2
    assert cache.layer_types == ("full_attention",) * 3

    llama = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 64}
    cache = Cache.from_config(llama, batch_size=3, max_length=8)
    assert cache.layer_types == ("full_attention",) * 2
    for layer in cache.layers:
        assert type(layer) is StaticLayer
        chex.assert_shape(layer.keys, (3, 8, 8, 8))
    cache = Cache.from_config(dict(llama, num_key_value_heads=2), batch_size=1, full_attention="dynamic")
    assert all(type(layer) is DynamicLayer for layer in cache.layers)
    chex.assert_shape(cache.layers[0].keys, (1, 2, 0, 8))


@pytest.mark.parametrize(
    "config, kwargs, error, pattern",
    [
        pytest.param(
            {"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_magic"], "num_attention_heads": 2, "head_dim": 4},
            {"max_length": 8}, ValueError,
            r"unknown layer type.*linear_magic.*chunked_attention.*full_attention.*sliding_attention",
            id="unknown-layer-type",
        ),
        pytest.param(
            {"num_hidden_layers": 3, "layer_types": ["full_attention"] * 2, "num_attention_heads": 2, "head_dim": 4},
            {"max_length": 8}, ValueError, r"2 layer_types but num_hidden_layers is 3", id="length-mismatch",
        ),
        pytest.param(
            {"layer_types": ["sliding_attention"], "num_attention_heads": 2, "head_dim": 4},
            {}, ValueError, r"sliding_window", id="sliding-without-window",
        ),
        pytest.param(
            {"layer_types": ["chunked_attention"], "num_attention_heads": 2, "head_dim": 4},
            {}, ValueError, r"attention_chunk_size", id="chunked-without-chunk",
        ),
        pytest.param(
            {"num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 4},
            {"max_length": 8, "full_attention": "paged"}, ValueError,
            r"full_attention must be one of \('static', 'dynamic'\), got 'paged'", id="bad-full-attention",
        ),
        pytest.param(
            {"num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 4},
            {}, ValueError, r"needs max_length", id="static-without-max-length",
        ),
        pytest.param(
            {"num_hidden_layers": 1, "num_attention_heads": 2}, {"max_length": 8}, ValueError,
            r"head_dim", id="no-head-dim",
        ),
    ],
)  # fmt: skip
def test_from_config_errors_name_the_problem(config, kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        Cache.from_config(config, batch_size=1, **kwargs)


# --- per-row lengths -------------------------------------------------------------------
def test_per_row_lengths_and_next_positions():
    """Each row keeps its own length; ``next_positions(T, num_new)`` pads rows that take
    fewer tokens with -1, and every layer agrees on the lengths."""
    rng = np.random.default_rng(0)
    cache = make_cache()
    positions = cache.next_positions(6, num_new=jnp.asarray([4, 2, 0]))
    np.testing.assert_array_equal(positions, [[0, 1, 2, 3, -1, -1], [0, 1, -1, -1, -1, -1], [-1] * 6])
    cache, views, _ = feed_jit(cache, *rand_tokens(rng, 3, 6), positions)
    np.testing.assert_array_equal(cache.lengths, [4, 2, 0])
    for layer in cache.layers:
        np.testing.assert_array_equal(layer.lengths, [4, 2, 0])
    np.testing.assert_array_equal(
        views[0].mask_info.kv_positions[:, :5], [[0, 1, 2, 3, -1], [0, 1, -1, -1, -1], [-1] * 5]
    )
    np.testing.assert_array_equal(cache.next_positions(2), [[4, 5], [2, 3], [0, 1]])
    positions = cache.next_positions(2, num_new=[1, 2, 0])
    np.testing.assert_array_equal(positions, [[4, -1], [2, 3], [-1, -1]])
    cache, _, _ = feed_jit(cache, *rand_tokens(rng, 3, 2), positions)
    np.testing.assert_array_equal(cache.lengths, [5, 4, 0])


# --- batch edits -----------------------------------------------------------------------
class BatchEditTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("static", "dynamic")
    def test_reorder_gathers_every_leaf_of_every_layer(self, full_attention):
        """Beam reorder: every leaf of every layer type (K, V, slot positions, lengths) is
        gathered along the batch, so no beam mixes another's storage (reference bug: only
        part of the storage was reordered, PRs #45510/#48700)."""
        cache = make_cache(full_attention=full_attention)
        cache = ragged_prefill(cache, np.random.default_rng(1), [5, 3, 4])
        leaves = jax.tree.leaves(cache)  # each [layers in group, B, ...]: batch is axis 1
        assert len(leaves) == 3 + 4 + 4
        for leaf in leaves:  # rows differ in every leaf, so a missed leaf would show
            assert not np.array_equal(np.asarray(leaf)[:, 0], np.asarray(leaf)[:, 2])
        indices = jnp.asarray([2, 0, 2, 1])
        beams = self.variant(lambda c, i: c.reorder(i))(cache, indices)
        assert beams.layer_types == cache.layer_types
        expected = jax.tree.map(lambda leaf: np.take(np.asarray(leaf), np.asarray(indices), axis=1), cache)
        chex.assert_trees_all_equal(beams, expected)
        np.testing.assert_array_equal(beams.lengths, [4, 5, 4, 3])

    def test_select_and_repeat(self):
        """select keeps the named rows; repeat(2) interleaves: row0, row0, row1, row1."""
        cache = ragged_prefill(make_cache(), np.random.default_rng(2), [3, 5, 1])
        one = cache.select(jnp.asarray([1]))
        chex.assert_trees_all_equal(one, jax.tree.map(lambda leaf: np.asarray(leaf)[:, 1:2], cache))
        assert one.batch_size == 1
        two = cache.select(jnp.asarray([2, 0]))
        chex.assert_trees_all_equal(two, jax.tree.map(lambda leaf: np.asarray(leaf)[:, [2, 0]], cache))
        twice = cache.repeat(2)
        chex.assert_trees_all_equal(twice, jax.tree.map(lambda leaf: np.asarray(leaf)[:, [0, 0, 1, 1, 2, 2]], cache))
        np.testing.assert_array_equal(twice.lengths, [3, 3, 5, 5, 1, 1])
        with pytest.raises(ValueError, match="num_repeats must be positive"):
            cache.repeat(0)
        with pytest.raises(IndexError, match="out of range"):
            cache.select(jnp.asarray([3]))

    def test_repeat_prefilled_row_then_decode_equals_prefilling_each_copy(self):
        """One prompt prefilled once and repeated to 3 rows (reference issue #27449)
        decodes exactly like a batch of 3 that prefilled the prompt 3 times."""
        rng = np.random.default_rng(3)
        q, k, v = rand_tokens(rng, 1, 6)
        positions = jnp.arange(6, dtype=jnp.int32)[None]
        once, _, _ = feed_jit(make_cache(batch=1), q, k, v, positions)
        tile = lambda x: jnp.tile(x, (3,) + (1,) * (x.ndim - 1))
        thrice, _, _ = feed_jit(make_cache(), tile(q), tile(k), tile(v), tile(positions))
        repeated = once.repeat(3)
        chex.assert_trees_all_equal(repeated, thrice)
        step = feed_jit
        for width in (1, 2):  # each copy continues differently
            tokens = rand_tokens(rng, 3, width)
            positions = repeated.next_positions(width)
            repeated, views, outs = step(repeated, *tokens, positions)
            thrice, ref_views, ref_outs = step(thrice, *tokens, positions)
            chex.assert_trees_all_equal(outs, ref_outs)
            chex.assert_trees_all_equal(views, ref_views)
        chex.assert_trees_all_equal(repeated, thrice)
        assert not np.allclose(outs[0][0], outs[0][1])


# --- rollback --------------------------------------------------------------------------
class RollbackTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("static", "dynamic", "sliding", "chunked")
    def test_rollback_then_refeed_equals_never_fed(self, kind):
        """Feed 5, feed n (large garbage), roll back n, then feed 2 and 5 tokens: every
        step returns what a cache that never saw the garbage returns (admitted keys and
        values, attention outputs), and stores the same where visible. Windowed layers
        carry R=2 rollback slots and undo their whole budget, ``max_rollback`` (the
        reference cannot roll back a sliding window); full attention undoes 3."""
        rng = np.random.default_rng(4)
        step, undo = self.variant(feed), self.variant(lambda c, n: c.rollback(n))

        def go(cache, tokens):
            width = tokens[1].shape[2]
            positions = cache.next_positions(width)
            cache, views, outs = step(cache.reserve(width), *tokens, positions)
            return cache, views[0], outs[0], positions

        prefix = rand_tokens(rng, 2, 5)
        ref = go(make_kind(kind, batch=2), prefix)[0]
        rolled = go(make_kind(kind, batch=2), prefix)[0]
        n = rolled.max_rollback or 3
        assert n >= 2
        rolled = go(rolled, rand_tokens(rng, 2, n, scale=100.0))[0]
        np.testing.assert_array_equal(rolled.lengths, [5 + n, 5 + n])
        rolled = undo(rolled, n)
        np.testing.assert_array_equal(rolled.lengths, [5, 5])
        for width in (2, 5):  # 2: answered from the ring (T <= R + 1); 5: ring + new tokens
            tokens = rand_tokens(rng, 2, width)
            ref, ref_view, ref_out, positions = go(ref, tokens)
            rolled, view, out, rolled_positions = go(rolled, tokens)
            np.testing.assert_array_equal(rolled_positions, positions)
            np.testing.assert_array_equal(rolled.lengths, ref.lengths)
            assert admitted(view, positions) == admitted(ref_view, positions)
            chex.assert_trees_all_close(out, ref_out, atol=1e-6, rtol=0)
            for row in range(2):
                mine, theirs = visible(rolled.layers[0], row), visible(ref.layers[0], row)
                length = int(ref.lengths[row])
                needed = {
                    "sliding": range(length - WINDOW + 1, length),
                    "chunked": range(length // CHUNK * CHUNK, length),
                }
                for p in needed.get(kind, range(length)):  # what the next query may read
                    assert p in mine and p in theirs
                assert all(theirs.get(p) == stored for p, stored in mine.items())
                if kind in ("static", "dynamic"):
                    assert mine == theirs

    def test_rollback_past_max_rollback_raises_eagerly(self):
        """Eagerly, undoing more than ``max_rollback`` is an error that names the count and
        the budget; a negative count too. A ring of W + R slots undoes R + 1 tokens (the
        bare ring already holds the W - 1 keys the re-fed token needs after undoing one);
        full attention alone is unbounded, but never rolls back past a row's start."""
        cache = make_cache(["full_attention", "sliding_attention"], batch=2)
        cache = ragged_prefill(cache, np.random.default_rng(5), [6, 6])
        budget = cache.max_rollback
        assert budget == 3 == cache.layers[1].max_rollback
        assert cache.layers[0].max_rollback is None
        with pytest.raises(ValueError, match=rf"undo {budget + 1} tokens.*at most {budget}"):
            cache.rollback(budget + 1)
        with pytest.raises(ValueError, match=rf"undo {budget + 1} tokens"):
            cache.rollback(jnp.asarray([0, budget + 1]))
        with pytest.raises(ValueError, match="negative"):
            cache.rollback(-1)
        for layer in cache.rollback(budget).layers:
            np.testing.assert_array_equal(layer.lengths, [6 - budget] * 2)
        full = ragged_prefill(make_cache(["full_attention"], batch=2), np.random.default_rng(5), [6, 2])
        assert full.max_rollback is None
        np.testing.assert_array_equal(full.rollback(5).lengths, [1, 0])

    def test_rollback_under_jit_clamps_to_max_rollback(self):
        """Under jit the count cannot be checked, so it is clamped to ``max_rollback`` (and
        to each row's length) in every layer, keeping the layers in step."""
        cache = make_cache(["full_attention", "sliding_attention"], batch=2)
        cache = ragged_prefill(cache, np.random.default_rng(6), [6, 1])
        budget = cache.max_rollback
        undo = jax.jit(lambda c, n: c.rollback(n))
        clamped = [6 - budget, 0]
        for n, want in ((5, clamped), (jnp.asarray([5, 1]), clamped), (jnp.asarray([1, 0]), [5, 1])):
            rolled = undo(cache, n)
            for layer in rolled.layers:
                np.testing.assert_array_equal(layer.lengths, want)
        rolled = jax.jit(lambda c: c.rollback(7))(cache)  # a constant inside jit too
        for layer in rolled.layers:
            np.testing.assert_array_equal(layer.lengths, clamped)

    def test_per_row_rollback_then_refeed_restores_the_cache(self):
        """rollback([2, 0, 1]) undoes a different count per row; re-feeding those tokens at
        ``next_positions`` (ragged) gives back the very same cache, every leaf."""
        rng = np.random.default_rng(7)
        cache = make_cache()
        q, k, v = rand_tokens(rng, 3, 6)
        full, _, _ = feed_jit(cache, q, k, v, cache.next_positions(6))
        rolled = full.rollback(jnp.asarray([2, 0, 1]))
        for layer in rolled.layers:
            np.testing.assert_array_equal(layer.lengths, [4, 6, 5])
        positions = rolled.next_positions(2, num_new=jnp.asarray([2, 0, 1]))
        np.testing.assert_array_equal(positions, [[4, 5], [-1, -1], [5, -1]])
        take = np.asarray([[4, 5], [0, 0], [5, 5]])  # the original tokens at those positions
        pick = lambda x: jnp.take_along_axis(x, jnp.asarray(take)[:, None, :, None], axis=2)
        restored, views, _ = feed(rolled, pick(q), pick(k), pick(v), positions)
        np.testing.assert_array_equal(views[0].mask_info.kv_positions[:, :7], [list(range(6)) + [-1]] * 3)
        chex.assert_trees_all_equal(restored, full)


# --- reset and prefix reuse ------------------------------------------------------------
class ResetTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("static", "dynamic")
    def test_reset_keeps_shapes_and_empties(self, full_attention):
        """reset keeps every shape and dtype (so compiled steps are reused), sets lengths to
        0 and ring slot positions to -1; the next update then sees nothing of the past."""
        rng = np.random.default_rng(8)
        cache = make_cache(full_attention=full_attention)
        cache = ragged_prefill(cache, rng, [5, 3, 4])
        empty = self.variant(lambda c: c.reset())(cache)
        chex.assert_trees_all_equal_shapes_and_dtypes(empty, cache)
        assert empty.layer_types == cache.layer_types
        np.testing.assert_array_equal(empty.lengths, [0, 0, 0])
        for layer in empty.layers:
            np.testing.assert_array_equal(layer.lengths, [0, 0, 0])
            np.testing.assert_array_equal(layer.keys, 0.0)
            if hasattr(layer, "slot_positions"):
                np.testing.assert_array_equal(layer.slot_positions, -1)
        tokens = rand_tokens(rng, 3, 2)
        positions = empty.next_positions(2)
        np.testing.assert_array_equal(positions, [[0, 1]] * 3)
        fresh = make_cache(full_attention=full_attention).reserve(2)
        _, views, outs = feed_jit(empty, *tokens, positions)
        _, fresh_views, fresh_outs = feed_jit(fresh, *tokens, positions)
        chex.assert_trees_all_close(outs, fresh_outs, atol=1e-6, rtol=0)
        for view, fresh_view in zip(views, fresh_views):
            assert admitted(view, positions) == admitted(fresh_view, positions)


def test_prefix_reuse_leaves_the_prefix_untouched():
    """One prefilled cache seeds two continuations: the prefix is unchanged (no deepcopy
    needed: immutable pytrees) and each continuation equals one built from scratch."""
    rng = np.random.default_rng(9)
    prompt = rand_tokens(rng, 3, 6)
    positions = jnp.tile(jnp.arange(6, dtype=jnp.int32), (3, 1))
    prefix, _, _ = feed_jit(make_cache(), *prompt, positions)
    snapshot = jax.tree.map(np.array, prefix)
    results = []
    for seed in (10, 11):
        cont_rng = np.random.default_rng(seed)
        conts = [rand_tokens(cont_rng, 3, w) for w in (2, 1)]
        cache, outs = prefix, []
        for tokens in conts:
            cache, _, out = feed_jit(cache, *tokens, cache.next_positions(tokens[1].shape[2]))
            outs.append(out)
        scratch, _, _ = feed_jit(make_cache(), *prompt, positions)
        scratch_outs = []
        for tokens in conts:
            scratch, _, out = feed_jit(scratch, *tokens, scratch.next_positions(tokens[1].shape[2]))
            scratch_outs.append(out)
        chex.assert_trees_all_close(outs, scratch_outs, atol=0, rtol=0)
        chex.assert_trees_all_equal(cache, scratch)
        results.append(outs)
    chex.assert_trees_all_equal(prefix, snapshot)
    np.testing.assert_array_equal(prefix.lengths, [6, 6, 6])
    assert not np.allclose(results[0][-1][0], results[1][-1][0])


# --- static overflow -------------------------------------------------------------------
def test_static_overflow_eager_raises_naming_max_length():
    cache = make_cache(["full_attention"], batch=1, max_length=4)
    cache = ragged_prefill(cache, np.random.default_rng(12), [3], width=3)
    _, k, v = rand_tokens(np.random.default_rng(12), 1, 2)
    with pytest.raises(ValueError, match=r"would reach 5 tokens but the capacity is 4.*max_length >= 5"):
        cache.update(0, k, v)
    cache, _ = cache.update(0, k[:, :, :1], v[:, :, :1])  # exactly full is fine
    np.testing.assert_array_equal(cache.lengths, [4])
    assert not bool(cache.overflowed[0])


def test_static_overflow_at_trace_time_raises():
    """T > max_length can never fit: refused while tracing, before anything runs."""
    cache = make_cache(["full_attention"], batch=1, max_length=4)
    _, k, v = rand_tokens(np.random.default_rng(13), 1, 5)
    with pytest.raises(ValueError, match=r"5 new tokens cannot fit in a capacity of 4.*max_length"):
        jax.jit(lambda c, k, v: c.update(0, k, v)[0])(cache, k, v)


def test_static_overflow_under_jit_drops_without_clamping():
    """Under jit a write at or past max_length is dropped: live slots are never overwritten
    (``dynamic_update_slice`` would clamp the write back onto them), lengths still count
    the tokens, and ``overflowed`` flags that row only."""
    cache = make_cache(["full_attention", "sliding_attention"], batch=2, head_dim=1, max_length=4)
    k = jnp.asarray([[1, 2, 3], [11, 999, 999]], jnp.float32)[:, None, :, None]
    cache, _, _ = feed_jit(cache, jnp.tile(k, (1, 2, 1, 1)), k, k, jnp.asarray([[0, 1, 2], [0, -1, -1]]))

    @jax.jit
    def step(cache, k):
        cache, _, _ = feed(cache, jnp.tile(k, (1, 2, 1, 1)), k, k, cache.next_positions(k.shape[2]))
        return cache

    cache = step(cache, jnp.asarray([[4, 5], [12, 13]], jnp.float32)[:, None, :, None])
    static = cache.layers[0]
    np.testing.assert_array_equal(static.keys[:, 0, :, 0], [[1, 2, 3, 4], [11, 12, 13, 0]])
    np.testing.assert_array_equal(cache.lengths, [5, 3])
    np.testing.assert_array_equal(cache.overflowed, [True, False])
    cache = step(cache, jnp.asarray([[6], [14]], jnp.float32)[:, None, :, None])
    np.testing.assert_array_equal(cache.layers[0].keys[:, 0, :, 0], [[1, 2, 3, 4], [11, 12, 13, 14]])
    np.testing.assert_array_equal(cache.layers[0].values[:, 0, :, 0], [[1, 2, 3, 4], [11, 12, 13, 14]])
    np.testing.assert_array_equal(cache.lengths, [6, 4])
    np.testing.assert_array_equal(cache.overflowed, [True, False])
    assert not has(cache.layers[1], Overflow)  # the ring never overflows: it keeps its last W tokens


# --- donation --------------------------------------------------------------------------
@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_donated_decode_step_updates_in_place(layer_type):
    """A jitted decode step (T=1) with the cache donated aliases the whole K/V to the
    output and needs only small temporaries; without donation nothing is aliased, so the
    check can tell the two apart."""
    cache = Cache.from_layer_types(
        [layer_type] * 2, batch_size=2, num_kv_heads=4, head_dim=64, max_length=1024, sliding_window=1024
    )
    assert kv_bytes(cache) == 8 * 2**20
    q, k, v = rand_tokens(np.random.default_rng(14), 2, 1, heads=4, head_dim=64)

    def step(cache, q, k, v):
        cache, _, outs = feed(cache, q, k, v, cache.next_positions(1))
        return cache, outs

    donated = jax.jit(step, donate_argnums=0).lower(cache, q, k, v).compile()
    stats = donated.memory_analysis()
    assert stats is not None
    assert stats.alias_size_in_bytes >= kv_bytes(cache)
    # Temporaries hold the blocked attention's K/V blocks (2 x 1 MiB here), never a copy
    # of a layer (4 MiB) or of the cache (8 MiB).
    assert stats.temp_size_in_bytes < kv_bytes(cache) / 2
    plain = jax.jit(step).lower(cache, q, k, v).compile().memory_analysis()
    assert plain.alias_size_in_bytes == 0
    assert plain.output_size_in_bytes >= kv_bytes(cache)  # a second copy of the cache

    new_cache, outs = donated(cache, q, k, v)
    np.testing.assert_array_equal(new_cache.lengths, [1, 1])
    chex.assert_shape(outs, [(2, 8, 1, 64)] * 2)
    np.testing.assert_allclose(outs[0], jnp.repeat(v, 2, axis=1), atol=1e-6)  # one key: output = its value


def test_scanned_decode_temporaries_do_not_grow_with_capacity():
    """A decode step scanning over a stacked cache (as the models do) reads each layer's
    K/V in blocks straight from the stack: its temporaries are the same at 2k and 8k
    capacity (both read in 512-slot blocks; slicing the layer out of the stack first would
    copy it, 4x more at 8k)."""

    def temp_bytes(capacity):
        cache = Cache.from_layer_types(
            ["full_attention"] * 4, batch_size=1, num_kv_heads=2, head_dim=64, max_length=capacity, stacked=True
        )
        q, k, v = rand_tokens(np.random.default_rng(15), 1, 1, heads=2, head_dim=64)

        def step(cache, q, k, v):
            positions = cache.next_positions(1)

            def layer(carry, i):
                cache, x = carry
                cache, kv = cache.update(i, k, v, positions)
                return (cache, x + attention(q, kv, positions)), None

            (cache, x), _ = jax.lax.scan(layer, (cache, q), jnp.arange(4))
            return cache, x

        stats = jax.jit(step, donate_argnums=0).lower(cache, q, k, v).compile().memory_analysis()
        assert stats.alias_size_in_bytes >= kv_bytes(cache)
        return stats.temp_size_in_bytes

    small, large = temp_bytes(2048), temp_bytes(8192)
    layer_slice = 2 * 1 * 2 * 8192 * 64 * 4  # one layer's K+V at 8k: 8 MiB
    assert large <= small + 64 * 1024, (small, large)
    assert large < layer_slice / 8


# --- footprint -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["static", "dynamic", "sliding", "chunked"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nbytes_is_leaf_sum_and_matches_formula(kind, dtype):
    """nbytes counts every leaf, and ``memory.layer_bytes`` predicts it for each type."""
    b, h, d, s, r = 2, 3, 8, 40, 2
    if kind == "static":
        layer = StaticLayer.create(b, h, d, s, dtype)
    elif kind == "dynamic":
        layer = DynamicLayer.create(b, h, d, dtype).reserve(s)
    else:
        cls = SlidingWindowLayer if kind == "sliding" else ChunkedLayer
        layer = cls.create(b, h, d, WINDOW, dtype, rollback_slots=r)
    leaf_sum = sum(leaf.nbytes for leaf in jax.tree.leaves(layer))
    assert layer.nbytes == leaf_sum
    layer_type = {"static": "full_attention", "dynamic": "full_attention"}.get(kind, f"{kind}_attention")
    predicted = layer_bytes(
        layer_type, batch_size=b, seq_len=s, num_kv_heads=h, head_dim=d, dtype=dtype, window=WINDOW, chunk=CHUNK,
        rollback_slots=r, full_attention="dynamic" if kind == "dynamic" else "static",
    )  # fmt: skip
    assert predicted == layer.nbytes
    cache = make_kind(kind, batch=b, heads=h, head_dim=d, max_length=s, rollback_slots=r, dtype=dtype).reserve(s)
    assert cache.nbytes == sum(leaf.nbytes for leaf in jax.tree.leaves(cache)) == predicted


def test_cache_bytes_equals_allocated_cache():
    """``memory.cache_bytes(config, ...)`` is the allocated cache's nbytes, and the sum of
    ``layer_bytes`` over the config's layers."""
    for dtype in (jnp.float32, jnp.bfloat16):
        predicted = cache_bytes(GEMMA3_LIKE, 2, 64, dtype)
        cache = Cache.from_config(GEMMA3_LIKE, batch_size=2, max_length=64, dtype=dtype)
        assert predicted == cache.nbytes
        per_layer = sum(
            layer_bytes(t, batch_size=2, seq_len=64, num_kv_heads=4, head_dim=16, dtype=dtype, window=8)
            for t in GEMMA3_LIKE["layer_types"]
        )
        assert predicted == per_layer


def test_cache_bytes_for_growing_full_attention():
    """With ``full_attention='dynamic'``, ``cache_bytes(config, batch, seq_len)`` must be the
    bytes of a cache holding ``seq_len`` tokens (what ``reserve(seq_len)`` allocates, and
    what ``layer_bytes(..., full_attention='dynamic')`` says), not of an empty one."""
    cache = Cache.from_config(GEMMA3_LIKE, batch_size=2, dtype=jnp.float32, full_attention="dynamic").reserve(64)
    per_layer = sum(
        layer_bytes(t, batch_size=2, seq_len=64, num_kv_heads=4, head_dim=16, dtype=jnp.float32, window=8,
                    full_attention="dynamic")
        for t in GEMMA3_LIKE["layer_types"]
    )  # fmt: skip
    assert cache.nbytes == per_layer
    assert cache_bytes(GEMMA3_LIKE, 2, 64, jnp.float32, full_attention="dynamic") == cache.nbytes


def test_ring_bytes_do_not_grow_with_sequence_length():
    """A sliding or chunked layer holds W + R slots at 10 tokens or a million; a static
    layer's bytes do grow with the length it is sized for."""
    common = {"batch_size": 2, "num_kv_heads": 2, "head_dim": 8, "window": WINDOW, "chunk": CHUNK, "rollback_slots": 1}
    for layer_type in ("sliding_attention", "chunked_attention"):
        assert layer_bytes(layer_type, seq_len=16, **common) == layer_bytes(layer_type, seq_len=2**20, **common)
    assert layer_bytes("full_attention", seq_len=32, **common) > layer_bytes("full_attention", seq_len=16, **common)
    rng = np.random.default_rng(15)
    cache = make_cache(["sliding_attention", "chunked_attention"], batch=2, rollback_slots=1)
    before = cache.nbytes
    for width in (6, 1, 9):
        cache, _, _ = feed_jit(cache, *rand_tokens(rng, 2, width), cache.next_positions(width))
        assert cache.nbytes == before
    np.testing.assert_array_equal(cache.lengths, [16, 16])


# --- repr ------------------------------------------------------------------------------
def test_repr_lists_each_layer_and_works_under_jit():
    cache = ragged_prefill(make_cache(), np.random.default_rng(16), [3, 1, 0])
    text = repr(cache)
    lines = text.splitlines()
    assert len(lines) == 4
    assert "batch=3" in lines[0] and "layers=3" in lines[0] and "lengths=[3, 1, 0]" in lines[0]
    assert f"{cache.nbytes} B" in lines[0] or "KiB" in lines[0]
    for line, layer_type, layer in zip(lines[1:], ALL_TYPES, cache.layers):
        assert layer_type in line and type(layer).__name__ in line
        assert f"{layer.nbytes} B" in line
        assert str(list(layer.keys.shape)) in line and "float32" in line
    assert "window=4" in lines[2] and "R=2" in lines[2]
    assert "chunk=4" in lines[3] and "R=2" in lines[3]
    seen = []

    @jax.jit
    def f(cache):
        seen.append(repr(cache))
        return cache.lengths

    np.testing.assert_array_equal(f(cache), [3, 1, 0])
    traced = seen[0].splitlines()
    assert "lengths=traced" in traced[0]
    assert traced[1:] == lines[1:]


# --- input errors ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["static", "dynamic", "sliding", "chunked"])
def test_bad_inputs_raise_clear_errors(kind):
    """Wrong head count, head dim, batch or dtype (float32 into a bfloat16 cache), keys and
    values that differ, positions of the wrong shape, positions that skip or do not start
    at the row's length (eagerly), and a bad layer index each raise an error naming the
    problem."""
    cache = make_kind(kind, batch=2, heads=2, head_dim=4, dtype=jnp.bfloat16)
    good = jnp.zeros((2, 2, 1, 4), jnp.bfloat16)
    expected = r"expected \[B, H_kv, T, D\] = \[2, 2, T, 4\]"
    with pytest.raises(ValueError, match=r"keys has shape \(2, 3, 1, 4\), " + expected):
        cache.update(0, jnp.zeros((2, 3, 1, 4), jnp.bfloat16), good)
    with pytest.raises(ValueError, match=r"values has shape \(2, 2, 1, 8\), " + expected):
        cache.update(0, good, jnp.zeros((2, 2, 1, 8), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"keys has shape \(3, 2, 1, 4\)"):
        cache.update(0, jnp.zeros((3, 2, 1, 4), jnp.bfloat16), jnp.zeros((3, 2, 1, 4), jnp.bfloat16))
    with pytest.raises(TypeError, match=r"keys dtype float32 differs from the cache dtype bfloat16"):
        cache.update(0, good.astype(jnp.float32), good)
    with pytest.raises(ValueError, match=r"keys \(2, 2, 1, 4\) and values \(2, 2, 2, 4\) differ"):
        cache.update(0, good, jnp.zeros((2, 2, 2, 4), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"positions has shape \(2, 2\), expected \[B, T\] = \[2, 1\]"):
        cache.update(0, good, good, jnp.zeros((2, 2), jnp.int32))
    two = jnp.zeros((2, 2, 2, 4), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"row 0 has length 0.*got \[0, 2\]"):
        cache.update(0, two, two, jnp.asarray([[0, 2], [0, 1]]))
    with pytest.raises(ValueError, match=r"row 1 has length 0.*got \[1, 2\]"):
        cache.update(0, two, two, jnp.asarray([[0, 1], [1, 2]]))
    with pytest.raises(IndexError, match=r"layer_idx must be an int in \[0, 1\)"):
        cache.update(1, good, good)
    # shape and dtype checks hold under jit too (at trace time)
    with pytest.raises(ValueError, match=r"keys has shape \(2, 3, 1, 4\)"):
        jax.jit(lambda c, k: c.update(0, k, k)[0])(cache.reserve(1), jnp.zeros((2, 3, 1, 4), jnp.bfloat16))
    cache, _ = cache.update(0, good, good)  # and the right inputs pass
    np.testing.assert_array_equal(cache.lengths, [1, 1])


@pytest.mark.parametrize("kind", ["static", "sliding"])
def test_float_positions_are_rejected(kind):
    """Positions must be integers: a float position (say 0.7 from a bad computation) must
    raise the ``positions must be integers`` error that ``check_update_inputs`` has, not be
    silently truncated to a slot."""
    cache = make_kind(kind, batch=2)
    good = jnp.zeros((2, 1, 1, 2), jnp.float32)
    with pytest.raises(TypeError, match="positions must be integers"):
        cache.update(0, good, good, jnp.asarray([[0.7], [0.2]], jnp.float32))


# --- stacked layers (scan over layers) ---------------------------------------------------
def test_stacked_cache_in_a_scan_equals_unstacked_updates():
    """A Gemma-like 2 sliding : 1 full pattern stored stacked (period 3) and updated from a
    ``lax.scan`` over pattern repeats with a traced index gives exactly what per-layer
    updates of an unstacked cache give, and the layout is what ``locate`` says."""
    types = ["sliding_attention", "sliding_attention", "full_attention"] * 3
    kwargs = dict(batch_size=2, num_kv_heads=1, head_dim=4, max_length=16, sliding_window=3)
    stacked = Cache.from_layer_types(types, stacked=True, **kwargs)
    flat = Cache.from_layer_types(types, **kwargs)
    assert stacked.period == 3 and flat.period == 9
    chex.assert_shape(stacked.groups[2].keys, (3, 2, 1, 16, 4))
    assert stacked.locate(7) == (1, 2)
    rng = np.random.default_rng(21)
    k = jnp.asarray(rng.normal(size=(9, 2, 1, 5, 4)), jnp.float32)
    positions = jnp.tile(jnp.arange(5, dtype=jnp.int32), (2, 1))

    @jax.jit
    def scanned(cache):
        def body(cache, r):
            outs = []
            for g in range(3):
                cache, (keys, _, _) = cache.update((g, r), k[3 * r + g], k[3 * r + g], positions)
                outs.append(keys.sum())
            return cache, jnp.stack(outs)

        return jax.lax.scan(body, cache, jnp.arange(3))

    stacked, sums = scanned(stacked)
    for i in range(9):
        flat, (keys, _, _) = flat.update(i, k[i], k[i], positions)
        np.testing.assert_allclose(sums[i // 3, i % 3], keys.sum(), atol=1e-5)
    chex.assert_trees_all_equal(stacked.layers, flat.layers)
    with pytest.raises(TypeError, match=r"pass \(group, index\)"):
        jax.jit(lambda c, i: c.update(i, k[0], k[0], positions))(stacked, 0)
    np.testing.assert_array_equal(stacked.rollback(1).lengths, [4, 4])
    chex.assert_trees_all_equal(stacked.reorder(jnp.asarray([1, 0])).layers[4].keys, flat.layers[4].keys[::-1])
