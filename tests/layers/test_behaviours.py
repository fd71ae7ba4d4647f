"""Layer types and masks: the "Layer types" and "Masks" sections of the checklist
(shared/reference/cache-behaviours.md) for static, dynamic, sliding-window and chunked
layers.

Keys and values are chosen so that a stored number says which token it came from
(key = position + 1, or the reference's 10, 20, 30, ...); padding tokens carry ``PAD``,
which must never be stored or seen. Where the reference is awkward we pin down the better
behaviour and say so in the test's docstring.
"""

import math

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
    KVView,
    MaskInfo,
    SlidingWindowLayer,
    StaticLayer,
    attention,
    attention_mask,
)
from tests.cases import make_layer

PAD = 999.0  # what padding tokens carry: never stored, never attended

# One compile per shape instead of one per primitive: keeps the file fast.
mask_of = jax.jit(attention_mask)
attend = jax.jit(attention, static_argnames=("scale", "logit_softcap"))
KINDS = ("static", "dynamic", "sliding", "chunked")


# --- helpers -------------------------------------------------------------------------
def tokens(vals, heads=1, head_dim=1):
    """``[B, T]`` numbers -> ``[B, H, T, D]`` with every head and feature equal to that number."""
    x = jnp.asarray(vals, jnp.float32)
    return jnp.broadcast_to(x[:, None, :, None], (x.shape[0], heads, x.shape[1], head_dim))


def pos(rows):
    return jnp.asarray(rows, jnp.int32)


def update(layer, keys, values, positions):
    return layer.update(keys, values, positions)


update_jit = jax.jit(update)


def ready(layer, num_tokens):
    """Dynamic layers must grow outside jit before a traced write of ``num_tokens``."""
    return layer.reserve(num_tokens) if isinstance(layer, DynamicLayer) else layer


def visible_map(layer, row=0):
    """{position: key number} of what a layer stores visibly for ``row``."""
    keys = np.asarray(layer.keys)[row, 0, :, 0]
    length = int(layer.lengths[row])
    if hasattr(layer, "slot_positions"):
        slot_pos = np.asarray(layer.slot_positions)[row]
        return {int(p): float(keys[s]) for s, p in enumerate(slot_pos) if 0 <= p < length}
    return {p: float(keys[p]) for p in range(length)}


def admitted_keys(view, q_positions, row=0):
    """Sorted key numbers of ``row`` that the mask admits for at least one query."""
    mask = np.asarray(mask_of(q_positions, view.mask_info))[row].any(axis=0)
    return sorted(np.asarray(view.keys)[row, 0, mask, 0].tolist())


def oracle_positions(q, window=None, chunk=None):
    """Positions full attention over the whole sequence lets the query at ``q`` see."""
    keep = [k for k in range(q + 1)]
    if window is not None:
        keep = [k for k in keep if k > q - window]
    if chunk is not None:
        keep = [k for k in keep if k // chunk == q // chunk]
    return keep


def np_attention(q, k, v, mask, scale, softcap=None):
    """One row, one head: q ``[T, D]``, k/v ``[S, D]``, mask ``[T, S]`` -> ``[T, D]`` (float64)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    logits = q @ k.T * scale
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    logits = np.where(mask, logits, -np.inf)
    out = np.zeros((q.shape[0], v.shape[1]))
    for t in range(q.shape[0]):
        if mask[t].any():
            w = np.exp(logits[t] - logits[t].max())
            out[t] = (w / w.sum()) @ v
    return out


# --- full attention, static -----------------------------------------------------------
class StaticLayerTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_write_lands_at_row_offset(self):
        """Checklist example, one row, S_max 4: [1,2,0,0] + write 3 at 2 -> [1,2,3,0]; the
        unwritten slot is hidden by its position (-1), not by its zero value."""
        step = self.variant(update)
        layer = StaticLayer.create(1, 1, 1, 4)
        layer, view = step(layer, tokens([[1, 2]]), tokens([[1, 2]]), pos([[0, 1]]))
        np.testing.assert_array_equal(layer.keys[0, 0, :, 0], [1, 2, 0, 0])
        np.testing.assert_array_equal(view.mask_info.kv_positions, [[0, 1, -1, -1]])
        layer, view = step(layer, tokens([[3]]), tokens([[3]]), pos([[2]]))
        np.testing.assert_array_equal(layer.keys[0, 0, :, 0], [1, 2, 3, 0])
        np.testing.assert_array_equal(layer.values[0, 0, :, 0], [1, 2, 3, 0])
        chex.assert_shape(view.keys, (1, 1, 4, 1))
        np.testing.assert_array_equal(view.keys[0, 0, :, 0], [1, 2, 3, 0])
        np.testing.assert_array_equal(view.mask_info.kv_positions, [[0, 1, 2, -1]])
        np.testing.assert_array_equal(mask_of(pos([[2]]), view.mask_info), [[[True, True, True, False]]])
        np.testing.assert_array_equal(layer.lengths, [3])

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("static", "dynamic")
    def test_rows_write_at_their_own_offsets(self, kind):
        """Ragged batch: each row is written at its own length; padding (-1, left or right)
        is neither stored nor counted."""
        step = self.variant(update)
        layer = make_layer(kind, batch=3, max_length=8)
        layer, _ = step(
            ready(layer, 3),
            tokens([[1, 2, 3], [11, PAD, PAD], [PAD, PAD, PAD]]),
            tokens([[1, 2, 3], [11, PAD, PAD], [PAD, PAD, PAD]]),
            pos([[0, 1, 2], [0, -1, -1], [-1, -1, -1]]),
        )
        np.testing.assert_array_equal(layer.lengths, [3, 1, 0])
        layer, view = step(
            ready(layer, 2),
            tokens([[4, 5], [PAD, 12], [21, 22]]),
            tokens([[4, 5], [PAD, 12], [21, 22]]),
            pos([[3, 4], [-1, 1], [0, 1]]),
        )
        np.testing.assert_array_equal(layer.lengths, [5, 2, 2])
        keys = np.asarray(layer.keys)[:, 0, :, 0]
        np.testing.assert_array_equal(keys[0, :5], [1, 2, 3, 4, 5])
        np.testing.assert_array_equal(keys[1, :2], [11, 12])
        np.testing.assert_array_equal(keys[2, :2], [21, 22])
        assert PAD not in keys
        kvp = np.asarray(view.mask_info.kv_positions)
        chex.assert_shape(view.keys, (3, 1, kvp.shape[1], 1))
        for row, length in enumerate([5, 2, 2]):
            np.testing.assert_array_equal(kvp[row, :length], np.arange(length))
            np.testing.assert_array_equal(kvp[row, length:], -1)


# --- full attention, growing ----------------------------------------------------------
def test_dynamic_grows_exactly_when_eager():
    """Eagerly the buffer grows to exactly the longest row (the reference's concatenation)."""
    layer = DynamicLayer.create(2, 1, 1)
    assert layer.capacity == 0
    lengths = np.zeros(2, int)
    for width in (3, 1, 4):
        counts = [width, width - 1]  # row 1 takes one token fewer (right padding)
        p = np.full((2, width), -1, np.int32)
        k = np.full((2, width), PAD, np.float32)
        for row, count in enumerate(counts):
            p[row, :count] = lengths[row] + np.arange(count)
            k[row, :count] = p[row, :count] + 1
        layer, view = layer.update(tokens(k), tokens(k), pos(p))
        lengths += counts
        assert layer.capacity == lengths.max()
        chex.assert_shape(view.keys, (2, 1, int(lengths.max()), 1))
    np.testing.assert_array_equal(layer.lengths, [8, 5])
    np.testing.assert_array_equal(np.asarray(layer.keys)[0, 0, :, 0], np.arange(1, 9))
    np.testing.assert_array_equal(np.asarray(layer.keys)[1, 0, :5, 0], np.arange(1, 6))


def test_dynamic_under_jit_traces_logarithmically():
    """reserve(1) before each jitted decode step: 40 steps meet O(log 40) capacities, each
    a power of two, and so only that many traces."""
    traces = []

    @jax.jit
    def step(layer, k, v):
        traces.append(layer.capacity)
        layer, _ = layer.update(k, v, layer.lengths[:, None])
        return layer

    layer = DynamicLayer.create(1, 1, 1)
    capacities = []
    for i in range(40):
        layer = layer.reserve(1)
        capacities.append(layer.capacity)
        layer = step(layer, tokens([[i + 1]]), tokens([[i + 1]]))
    distinct = sorted(set(capacities))
    assert len(traces) == len(distinct), (traces, distinct)
    assert len(traces) <= math.ceil(math.log2(40)) + 1
    for c in distinct:
        assert c & (c - 1) == 0, f"capacity {c} is not a power of two"
    assert layer.capacity >= 40
    np.testing.assert_array_equal(layer.lengths, [40])
    np.testing.assert_array_equal(np.asarray(layer.keys)[0, 0, :40, 0], np.arange(1, 41))
    assert not bool(layer.overflowed[0])


def test_dynamic_traced_write_beyond_capacity_asks_for_reserve():
    """Under jit the buffer cannot grow: a T larger than the capacity is refused at trace
    time with a message naming reserve, for the layer and through the container."""
    layer = DynamicLayer.create(1, 1, 1)
    with pytest.raises(ValueError, match="reserve"):
        jax.jit(update)(layer, tokens([[1, 2, 3]]), tokens([[1, 2, 3]]), pos([[0, 1, 2]]))
    cache = Cache.from_layer_types(
        ["full_attention"], batch_size=1, num_kv_heads=1, head_dim=1, full_attention="dynamic"
    )
    step = jax.jit(lambda c, k: c.update(0, k, k)[0])
    with pytest.raises(ValueError, match=r"reserve\(3\)"):
        step(cache, tokens([[1, 2, 3]]))
    with pytest.raises(RuntimeError, match="outside jit"):
        jax.jit(lambda c: c.reserve(3))(cache)
    cache = step(cache.reserve(3), tokens([[1, 2, 3]]))
    np.testing.assert_array_equal(cache.lengths, [3])
    np.testing.assert_array_equal(np.asarray(cache.layers[0].keys)[0, 0, :3, 0], [1, 2, 3])
    # Without reserve, a traced write past the capacity (16) is dropped like a static
    # layer's: nothing live is overwritten, lengths count it, overflowed reports it.
    assert cache.layers[0].capacity == 16
    for start in range(4, 19, 3):
        cache = step(cache, tokens([[start, start + 1, start + 2]]))
    np.testing.assert_array_equal(cache.lengths, [18])
    np.testing.assert_array_equal(np.asarray(cache.layers[0].keys)[0, 0, :, 0], np.arange(1, 17))
    np.testing.assert_array_equal(cache.overflowed, [True])


# --- sliding window and chunked rings --------------------------------------------------
class RingTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_sliding_ring_physical_and_logical_order(self):
        """W=4: [1,2,3,4] + 5 -> physically [5,2,3,4]; the slot positions give the logical
        order 2,3,4,5."""
        step = self.variant(update)
        layer = SlidingWindowLayer.create(1, 1, 1, 4)
        for value in (1, 2, 3, 4):
            layer, _ = step(layer, tokens([[value]]), tokens([[value]]), pos([[value - 1]]))
        np.testing.assert_array_equal(layer.keys[0, 0, :, 0], [1, 2, 3, 4])
        layer, view = step(layer, tokens([[5]]), tokens([[5]]), pos([[4]]))
        np.testing.assert_array_equal(layer.keys[0, 0, :, 0], [5, 2, 3, 4])
        np.testing.assert_array_equal(layer.slot_positions, [[4, 1, 2, 3]])
        chex.assert_shape(view.keys, (1, 1, 4, 1))
        kvp = np.asarray(view.mask_info.kv_positions)[0]
        np.testing.assert_array_equal(np.sort(kvp), [1, 2, 3, 4])
        np.testing.assert_array_equal(np.asarray(view.keys)[0, 0, np.argsort(kvp), 0], [2, 3, 4, 5])
        assert view.mask_info.window == 4
        np.testing.assert_array_equal(mask_of(pos([[4]]), view.mask_info), [[[True] * 4]])
        np.testing.assert_array_equal(layer.lengths, [5])

    @chex.variants(with_jit=True, without_jit=True)
    def test_sliding_prefill_longer_than_window_keeps_last(self):
        """A 6-token prefill into W=4 stores positions 2..5, while its first queries still
        see the tokens the ring does not keep."""
        step = self.variant(update)
        layer = SlidingWindowLayer.create(1, 1, 1, 4)
        q = pos([[0, 1, 2, 3, 4, 5]])
        layer, view = step(layer, tokens([[1, 2, 3, 4, 5, 6]]), tokens([[1, 2, 3, 4, 5, 6]]), q)
        assert visible_map(layer) == {2: 3.0, 3: 4.0, 4: 5.0, 5: 6.0}
        np.testing.assert_array_equal(layer.slot_positions, [[4, 5, 2, 3]])
        np.testing.assert_array_equal(layer.lengths, [6])
        mask = np.asarray(mask_of(q, view.mask_info))[0]
        kvp = np.asarray(view.mask_info.kv_positions)[0]
        for t in range(6):
            assert sorted(kvp[mask[t]].tolist()) == oracle_positions(t, window=4)
            np.testing.assert_array_equal(np.asarray(view.keys)[0, 0, mask[t], 0], kvp[mask[t]] + 1)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("sliding", "chunked")
    def test_multi_token_write_wraps_instead_of_clamping(self, kind):
        """Length 3 in a ring of 4, write 3 tokens: they land in slots 3, 0, 1. A clamped
        ``dynamic_update_slice`` would have put them in slots 1, 2, 3 over live tokens."""
        step = self.variant(update)
        layer = make_layer(kind, span=4)
        layer, _ = step(layer, tokens([[1, 2, 3]]), tokens([[1, 2, 3]]), pos([[0, 1, 2]]))
        layer, _ = step(layer, tokens([[4, 5, 6]]), tokens([[4, 5, 6]]), pos([[3, 4, 5]]))
        np.testing.assert_array_equal(layer.keys[0, 0, :, 0], [5, 6, 3, 4])
        np.testing.assert_array_equal(layer.values[0, 0, :, 0], [5, 6, 3, 4])
        np.testing.assert_array_equal(layer.slot_positions, [[4, 5, 2, 3]])
        np.testing.assert_array_equal(layer.lengths, [6])

    @chex.variants(with_jit=True, without_jit=True)
    def test_hybrid_reference_example_window_2(self):
        """Reference test (window 2): prefill 10,20,30 returns [10,20,30] and stores
        {20,30}; 50 returns [30,50]; 60,70 store {60,70} and return [50,60,70]. "Returns"
        means what the mask admits; the full-attention layer admits everything so far."""

        def step(cache, k, p):
            cache, full = cache.update(0, k, k, p)
            cache, sliding = cache.update(1, k, k, p)
            return cache, full, sliding

        step = self.variant(step)
        cache = Cache.from_layer_types(
            ["full_attention", "sliding_attention"],
            batch_size=1, num_kv_heads=1, head_dim=1, max_length=8, sliding_window=2,
        )  # fmt: skip
        expected = [
            ([10, 20, 30], [0, 1, 2], [10, 20, 30], {20, 30}),
            ([50], [3], [30, 50], {30, 50}),
            ([60, 70], [4, 5], [50, 60, 70], {60, 70}),
        ]
        seen = []
        for new, positions, returned, stored in expected:
            q = pos([positions])
            cache, full, sliding = step(cache, tokens([new]), q)
            seen += new
            assert admitted_keys(sliding, q) == returned
            assert set(visible_map(cache.layers[1]).values()) == stored
            assert admitted_keys(full, q) == seen
        # per query of the last update: 60 sees [50, 60], 70 sees [60, 70]
        mask = np.asarray(mask_of(q, sliding.mask_info))[0]
        keys = np.asarray(sliding.keys)[0, 0, :, 0]
        assert sorted(keys[mask[0]].tolist()) == [50, 60]
        assert sorted(keys[mask[1]].tolist()) == [60, 70]
        np.testing.assert_array_equal(cache.lengths, [6])

    @chex.variants(with_jit=True, without_jit=True)
    def test_chunked_sees_only_own_chunk_in_bounded_storage(self):
        """C=4: a query at q sees exactly the keys k <= q with k // 4 == q // 4, whatever the
        update width; the ring keeps C slots however many tokens were fed."""
        # The mask rule itself, on one row holding positions 0..11.
        everything = MaskInfo(jnp.arange(12, dtype=jnp.int32)[None], chunk=4)
        mask = np.asarray(mask_of(jnp.arange(12, dtype=jnp.int32)[None], everything))[0]
        q, k = np.arange(12)[:, None], np.arange(12)[None, :]
        np.testing.assert_array_equal(mask, (k <= q) & (k // 4 == q // 4))

        step = self.variant(update)
        layer = ChunkedLayer.create(1, 1, 1, 4)
        empty_bytes = layer.nbytes
        fed = 0
        for width in (3, 1, 5, 3):
            p = pos([np.arange(fed, fed + width)])
            layer, view = step(layer, tokens(p + 1), tokens(p + 1), p)
            fed += width
            m = np.asarray(mask_of(p, view.mask_info))[0]
            kvp = np.asarray(view.mask_info.kv_positions)[0]
            for t, qp in enumerate(np.asarray(p)[0]):
                assert sorted(kvp[m[t]].tolist()) == oracle_positions(int(qp), chunk=4)
                np.testing.assert_array_equal(np.asarray(view.keys)[0, 0, m[t], 0], kvp[m[t]] + 1)
            chex.assert_shape(layer.keys, (1, 1, 4, 1))
            assert layer.nbytes == empty_bytes
        assert fed == 12
        np.testing.assert_array_equal(layer.lengths, [12])


# --- what update returns and what the mask admits agree --------------------------------
class ReturnedKeysMatchMaskTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters("static", "dynamic", "sliding", "chunked_r2")
    def test_admitted_keys_are_exactly_the_oracles(self, kind):
        """For every layer type and T in {1, 2, 5}, ragged rows: the returned K/V and
        ``kv_positions`` have the same length, each admitted key is the real key of its
        position, and per query the admitted positions are exactly (no more, no fewer,
        no duplicates) the ones full causal / windowed / chunked attention would use
        (reference regression #48280 was a mismatch here). ``chunked_r2``: a ring with two
        rollback slots, so T=2 is answered from the ring itself (the sliding ring has
        none, so T=2 and T=5 take the ring-plus-new-tokens path)."""
        step = self.variant(update)
        for width in (1, 2, 5):
            self.check_width(step, kind, width)

    def check_width(self, step, kind, width):
        base, _, r = kind.partition("_")
        rule = {"sliding": {"window": 3}, "chunked": {"chunk": 4}}.get(base, {})
        layer = make_layer(base, batch=2, head_dim=2, span=3 if base == "sliding" else 4, rollback_slots=2 if r else 0)
        lengths = np.zeros(2, int)
        # prefill 3 and 1 tokens, then three updates of `width`; row 1 takes fewer.
        plan = [(3, [3, 1])] + [(width, [width, c]) for c in (width, max(width - 1, 0), width)]
        for w, counts in plan:
            p = np.full((2, w), -1, np.int32)
            k = np.full((2, 1, w, 2), PAD, np.float32)
            for row, count in enumerate(counts):
                p[row, :count] = lengths[row] + np.arange(count)
                k[row, 0, :count, 0] = p[row, :count] + 1
                k[row, 0, :count, 1] = row + 1
            layer, view = step(ready(layer, w), jnp.asarray(k), jnp.asarray(-k), jnp.asarray(p))
            lengths += counts
            np.testing.assert_array_equal(layer.lengths, lengths)
            kvp = np.asarray(view.mask_info.kv_positions)
            keys, values = np.asarray(view.keys), np.asarray(view.values)
            chex.assert_equal_shape_prefix([keys, values, kvp[:, None, :, None]], 3)
            mask = np.asarray(mask_of(jnp.asarray(p), view.mask_info))
            for row in range(2):
                for t in range(w):
                    slots = np.nonzero(mask[row, t])[0]
                    if p[row, t] < 0:
                        assert slots.size == 0, "a padding query must see nothing"
                        continue
                    assert sorted(kvp[row, slots].tolist()) == oracle_positions(int(p[row, t]), **rule)
                    np.testing.assert_array_equal(keys[row, 0, slots, 0], kvp[row, slots] + 1)
                    np.testing.assert_array_equal(keys[row, 0, slots, 1], row + 1)
                    np.testing.assert_array_equal(values[row, 0, slots], -keys[row, 0, slots])


# --- masks come from positions ----------------------------------------------------------
class MaskFromPositionsTest(chex.TestCase):
    @parameterized.parameters(*KINDS)
    def test_genuine_zero_vectors_are_attended(self, kind):
        """Tokens whose K and V are exactly zero are still tokens: the mask admits them
        (it is built from positions, never by counting non-zero slots) and they take their
        share of the softmax. Prefill (T=2) and decode (T=1) go through the same path."""
        step = update_jit
        layer = make_layer(kind, head_dim=2, span=4)
        k = np.array([[0, 0], [1, 0], [0, 0]], np.float32)  # position 0 and 2 are zero
        v = np.array([[0, 0], [0, 3], [0, 0]], np.float32)
        q = np.array([[0, 0], [1, 0], [2, 0]], np.float32)
        outs, masks = [], []
        for p in ([0, 1], [2]):
            layer, view = step(
                ready(layer, len(p)), jnp.asarray(k[None, None, p]), jnp.asarray(v[None, None, p]), pos([p])
            )
            m = mask_of(pos([p]), view.mask_info)
            outs.append(
                attend(jnp.asarray(q[None, None, p]), view, pos([p]), scale=1.0)
            )
            masks.append(np.asarray(m)[0, -1][np.asarray(view.mask_info.kv_positions)[0] >= 0])
        assert masks[1].sum() == 3, "the decode query at 2 must see all three tokens, zeros included"
        out = np.concatenate([np.asarray(o)[0, 0] for o in outs])
        causal = np.tril(np.ones((3, 3), bool))
        want = np_attention(q, k, v, causal, scale=1.0)
        np.testing.assert_allclose(out, want, atol=1e-6)
        # position 2: weights [1, e^2, 1] / (2 + e^2) on values [0, (0,3), 0]
        np.testing.assert_allclose(out[2], [0, 3 * np.e**2 / (2 + np.e**2)], atol=1e-6)
        nonzero = causal & (np.abs(k).sum(-1) > 0)[None, :]
        naive = np_attention(q, k, v, nonzero, scale=1.0)
        assert np.abs(out[2] - naive[2]).max() > 0.5, "zero-valued tokens were ignored"

    @parameterized.parameters(*KINDS)
    def test_padding_queries_get_zeros_not_nan(self, kind):
        """A padding query (position -1), or a row that is all padding, sees nothing and
        gets exact zeros rather than NaN, even with large logits."""
        layer = make_layer(kind, batch=2, head_dim=2, span=4)
        rng = np.random.default_rng(0)
        k = jnp.asarray(rng.normal(size=(2, 1, 3, 2)) * 50, jnp.float32)
        p = pos([[0, 1, -1], [-1, -1, -1]])
        layer, view = layer.update(k, k, p)
        q = jnp.asarray(rng.normal(size=(2, 2, 3, 2)) * 50, jnp.float32)
        out = np.asarray(attend(q, view, p))
        assert np.all(np.isfinite(out))
        np.testing.assert_array_equal(out[0, :, 2], 0.0)
        np.testing.assert_array_equal(out[1], 0.0)
        assert np.abs(out[0, :, :2]).max() > 0
        np.testing.assert_array_equal(layer.lengths, [2, 0])


@pytest.mark.parametrize("cls", [SlidingWindowLayer, ChunkedLayer])
def test_ring_lengths_count_tokens_not_slots(cls):
    """After 10 tokens into a ring of 4, lengths says 10 (reference PR #38156 read the
    number of stored slots instead), for the layer and for a container whose first layer
    is the ring, so the next positions are right."""
    layer = cls.create(1, 1, 1, 4)
    layer, _ = layer.update(tokens([np.arange(6) + 1.0]), tokens([np.arange(6) + 1.0]), pos([np.arange(6)]))
    for p in range(6, 10):
        layer, _ = layer.update(tokens([[p + 1.0]]), tokens([[p + 1.0]]), pos([[p]]))
    np.testing.assert_array_equal(layer.lengths, [10])
    chex.assert_shape(layer.keys, (1, 1, 4, 1))
    assert len(visible_map(layer)) == 4

    layer_type = "sliding_attention" if cls is SlidingWindowLayer else "chunked_attention"
    cache = Cache.from_layer_types(
        [layer_type, "full_attention"], batch_size=1, num_kv_heads=1, head_dim=1,
        max_length=16, sliding_window=4, attention_chunk_size=4,
    )  # fmt: skip
    for i in range(2):
        cache, _ = cache.update(i, tokens([np.arange(10.0)]), tokens([np.arange(10.0)]))
    np.testing.assert_array_equal(cache.lengths, [10])
    np.testing.assert_array_equal(cache.layers[1].lengths, [10])
    np.testing.assert_array_equal(cache.next_positions(1), [[10]])


# --- attention -----------------------------------------------------------------------
def test_gqa_equals_explicitly_repeated_kv_heads():
    """4 query heads over 2 K/V heads: query head h reads K/V head h // 2, the same as
    repeating each K/V head twice (not tiling them)."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 4, 3, 8)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 2, 5, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 2, 5, 8)), jnp.float32)
    info = MaskInfo(jnp.asarray([[0, 1, 2, 3, 4], [0, 1, 2, 3, -1]], jnp.int32))
    qp = pos([[2, 3, 4], [1, 2, 3]])
    out = attend(q, KVView.of(k, v, info), qp)
    repeated = attend(q, KVView.of(jnp.repeat(k, 2, axis=1), jnp.repeat(v, 2, axis=1), info), qp)
    chex.assert_shape(out, (2, 4, 3, 8))
    chex.assert_trees_all_close(out, repeated, atol=1e-6)
    mask = np.asarray(mask_of(qp, info))
    for b in range(2):
        for h in range(4):
            want = np_attention(q[b, h], k[b, h // 2], v[b, h // 2], mask[b], scale=8**-0.5)
            np.testing.assert_allclose(out[b, h], want, atol=1e-5)
    tiled = attend(q, KVView.of(jnp.tile(k, (1, 2, 1, 1)), jnp.tile(v, (1, 2, 1, 1)), info), qp)
    assert np.abs(np.asarray(out - tiled)).max() > 1e-2
    with pytest.raises(ValueError, match="multiple"):
        attend(q[:, :3], KVView.of(k, v, info), qp)


def test_logit_softcap_is_c_tanh_x_over_c():
    """``logit_softcap=c`` turns logits x into c * tanh(x / c) before the softmax (Gemma 2)."""
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, 2, 2, 4)) * 4, jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 4, 4)) * 4, jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 1, 4, 4)), jnp.float32)
    info = MaskInfo(jnp.asarray([[0, 1, 2, 3]], jnp.int32))
    qp = pos([[2, 3]])
    mask = np.asarray(mask_of(qp, info))[0]
    capped = attend(q, KVView.of(k, v, info), qp, scale=0.5, logit_softcap=2.0)
    plain = attend(q, KVView.of(k, v, info), qp, scale=0.5)
    for h in range(2):
        np.testing.assert_allclose(capped[0, h], np_attention(q[0, h], k[0, 0], v[0, 0], mask, 0.5, 2.0), atol=1e-5)
        np.testing.assert_allclose(plain[0, h], np_attention(q[0, h], k[0, 0], v[0, 0], mask, 0.5), atol=1e-5)
    assert np.abs(np.asarray(capped - plain)).max() > 1e-2


@pytest.mark.parametrize("num_slots, block_size", [(12, 512), (32, 8)])
@pytest.mark.parametrize("window", [None, 5])
def test_one_query_path_equals_the_batched_one(num_slots, block_size, window):
    """A one-row, one-token query takes a matrix-vector product per head (the form XLA's
    CPU backend fuses with a stacked cache's slice); read whole or in blocks, with GQA,
    a window and a softcap it equals the reference, and a padding query gets zeros."""
    rng = np.random.default_rng(21)
    q = jnp.asarray(rng.normal(size=(1, 6, 1, 8)) * 2, jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 2, num_slots, 8)) * 2, jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 2, num_slots, 8)), jnp.float32)
    filled = num_slots - 3
    kv_positions = jnp.where(jnp.arange(num_slots) < filled, jnp.arange(num_slots), -1)[None].astype(jnp.int32)
    info = MaskInfo(kv_positions, window=window, slots_used=jnp.int32(filled))
    qp = pos([[filled - 1]])
    mask = np.asarray(mask_of(qp, info))[0]
    attend_blocked = jax.jit(attention, static_argnames=("scale", "logit_softcap", "block_size"))
    out = attend_blocked(q, KVView.of(k, v, info), qp, scale=0.4, logit_softcap=3.0, block_size=block_size)
    for h in range(6):
        want = np_attention(q[0, h], k[0, h // 3], v[0, h // 3], mask, 0.4, 3.0)
        np.testing.assert_allclose(out[0, h], want, atol=1e-5)
    padding = attend_blocked(q, KVView.of(k, v, info), pos([[-1]]), block_size=block_size)
    np.testing.assert_array_equal(padding, np.zeros(padding.shape))


def test_default_blocks_follow_the_capacity():
    """Short buffers are read in small blocks (a decode step skips the empty tail), long
    ones in 512-slot blocks; a buffer shorter than two blocks is read whole."""
    from jaxkv.attention import attention_block_size

    assert [attention_block_size(n) for n in (12, 128, 256, 512, 1024, 2048, 8192, 32768)] == [
        64, 64, 64, 128, 256, 512, 512, 512,
    ]  # fmt: skip


@pytest.mark.parametrize("batch", [1, 3])
def test_default_blocked_read_equals_the_whole_read(batch):
    """A 512-slot buffer, ragged rows filled to 37 and 200 slots: the default (128-slot
    blocks up to the filled count) equals one whole read and the float64 reference."""
    rng = np.random.default_rng(22)
    num_slots, filled = 512, np.array([200, 37, 129][:batch])
    q = jnp.asarray(rng.normal(size=(batch, 6, 1, 8)) * 2, jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, 2, num_slots, 8)) * 2, jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, 2, num_slots, 8)), jnp.float32)
    slots = np.arange(num_slots)[None]
    kv_positions = jnp.asarray(np.where(slots < filled[:, None], slots, -1), jnp.int32)
    info = MaskInfo(kv_positions, slots_used=jnp.int32(filled.max()))
    qp = pos((filled - 1)[:, None].tolist())
    attend_blocked = jax.jit(attention, static_argnames=("block_size",))
    blocked = attend_blocked(q, KVView.of(k, v, info), qp)
    whole = attend_blocked(q, KVView.of(k, v, info), qp, block_size=num_slots)
    np.testing.assert_allclose(blocked, whole, atol=1e-6)
    mask = np.asarray(mask_of(qp, info))
    for b in range(batch):
        for h in range(6):
            want = np_attention(q[b, h], k[b, h // 3], v[b, h // 3], mask[b], 8**-0.5)
            np.testing.assert_allclose(blocked[b, h], want, atol=1e-5)
