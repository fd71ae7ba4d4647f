"""MLA's latent cache and DSA's indexed layer: the two attention forms agree with attention over
expanded per-head K/V, the indexer picks the brute-force top-k, the gather equals a dense mask
of the same selection, the indexer keys follow every row and time edit, and the byte formulas
equal what the layers allocate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxkv.models.architectures import DEEPSEEK_V32

from jaxkv.cache import Cache
from jaxkv.layers.indexed import IndexedQueries, IndexerQueries, index_scores, select_slots
from jaxkv.layers.paged import Paging
from jaxkv.memory import cache_bytes, layer_bytes
from jaxkv.mla import (
    LatentQueries,
    LatentSpec,
    LatentWeights,
    absorbed_attention,
    expanded_attention,
    prefers_expanded,
)  # fmt: skip
from jaxkv.protocol import MaskInfo
from jaxkv.quantization import QuantSpec

HEADS, NOPE, VALUE, RANK, ROPE, INDEX_DIM, INDEX_HEADS, TOPK = 3, 5, 7, 8, 4, 6, 2, 3
SPEC = LatentSpec(RANK, ROPE, INDEX_DIM, TOPK)
SCALE = 0.3


def normal(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def make_cache(kind="indexed_attention", full_attention="static", batch=2, max_length=16, spec=SPEC, **options):
    return Cache.from_layer_types(
        [kind], batch_size=batch, num_kv_heads=1, head_dim=4, max_length=max_length, full_attention=full_attention,
        latent=spec, **options,
    )  # fmt: skip


WEIGHTS = LatentWeights(normal(1, HEADS, NOPE + VALUE, RANK), NOPE)


def queries(seed, batch, length):
    return LatentQueries(normal(seed, batch, HEADS, length, NOPE), normal(seed + 1, batch, HEADS, length, ROPE))


def indexer_queries(seed, batch, length):
    return IndexerQueries(
        normal(seed, batch, length, INDEX_HEADS, INDEX_DIM), normal(seed + 1, batch, length, INDEX_HEADS)
    )


def reference(q: LatentQueries, entries, q_positions, kv_positions, selected=None):
    """Attention over per-head keys [W_uk c, k_r] and values W_uv c, expanded in NumPy."""
    entries, up = np.asarray(entries)[:, 0], np.asarray(WEIGHTS.up)
    keys = np.concatenate(
        [np.einsum("bsr,hnr->bhsn", entries[..., :RANK], up[:, :NOPE]),
         np.broadcast_to(entries[:, None, :, RANK:], (entries.shape[0], HEADS, entries.shape[1], ROPE))], -1,
    )  # fmt: skip
    values = np.einsum("bsr,hvr->bhsv", entries[..., :RANK], up[:, NOPE:])
    logits = np.einsum("bhtd,bhsd->bhts", np.concatenate([q.nope, q.rope], -1), keys) * SCALE
    qp, kp = np.asarray(q_positions)[:, None, :, None], np.asarray(kv_positions)[:, None, None, :]
    visible = (kp >= 0) & (qp >= 0) & (kp <= qp) & (True if selected is None else selected[:, None])
    logits = np.where(visible, logits, -np.inf)
    weights = np.exp(logits - np.max(np.where(visible, logits, 0), -1, keepdims=True))
    return np.einsum("bhts,bhsv->bhtv", weights / np.maximum(weights.sum(-1, keepdims=True), 1e-30), values)


@pytest.mark.parametrize("full_attention", ["static", "dynamic"])
def test_absorbed_and_plain_forms_equal_expanded_attention(full_attention):
    """A ragged prefill (row 1 padded), then a decode step: both forms give the attention of the
    expanded per-head K/V, and a padding query gets zeros."""
    cache = make_cache("latent_attention", full_attention)
    positions = cache.next_positions(5, num_new=[5, 3])
    for step, length in enumerate((5, 1)):
        entries = normal(10 + step, 2, 1, length, RANK + ROPE)
        cache, view = cache.update(0, entries, None, positions)
        q = queries(20 + step, 2, length)
        want = reference(q, view.keys, positions, view.mask_info.kv_positions)
        for form in (absorbed_attention, expanded_attention):
            np.testing.assert_allclose(form(q, view, positions, WEIGHTS, SCALE), want, atol=1e-5, err_msg=form.__name__)
        np.testing.assert_allclose(view.attend_latent(q, positions, WEIGHTS, SCALE), want, atol=1e-5)
        positions = cache.next_positions(1)
    assert np.all(
        np.asarray(absorbed_attention(queries(0, 2, 1), view, -jnp.ones((2, 1), jnp.int32), WEIGHTS, 1.0)) == 0
    )


def test_the_measured_rule_expands_only_a_long_deepseek_prefill():
    """Over 4096 slots, DeepSeek-V3's shapes (128 heads, R 512, P 64, n = v = 128) attend in the
    latent space for decode and a 256-query chunk and expand for a 4096-token prefill (crossing
    near 455 queries); the tiny shapes of the measurement (H 16, R 128, P 32, n = v = 64) never expand."""
    deepseek = LatentWeights(jax.ShapeDtypeStruct((128, 256, 512), jnp.bfloat16), 128)
    choose = [prefers_expanded(t, 4096, 128, 512, 64, deepseek) for t in (1, 256, 512, 4096)]
    assert choose == [False, False, True, True]
    measured = LatentWeights(jax.ShapeDtypeStruct((16, 128, 128), jnp.float32), 64)
    assert not any(prefers_expanded(t, 1024, 16, 128, 32, measured) for t in (1, 16, 64, 256, 1024))


def test_the_indexer_picks_the_brute_force_top_k():
    keys, indexer = normal(3, 2, 10, INDEX_DIM), indexer_queries(4, 2, 10)
    positions = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (2, 10))
    slots, chosen = select_slots(indexer, keys, positions, MaskInfo(positions), TOPK)
    q, w, k = (np.asarray(x, np.float64) for x in (indexer.queries, indexer.weights, keys))
    scores = np.einsum("bth,bths->bts", w, np.maximum(np.einsum("bthd,bsd->bths", q, k), 0))
    np.testing.assert_allclose(index_scores(indexer, keys), scores, atol=1e-5)
    for b in range(2):
        for t in range(10):  # the chosen scores are the best ones (ties, such as relu's zeros, in any order)
            ours = scores[b, t, np.asarray(slots[b, t])[np.asarray(chosen[b, t])]]
            np.testing.assert_allclose(np.sort(ours), np.sort(scores[b, t, : t + 1])[-TOPK:], atol=1e-5)


def attend(cache, seed, length, positions, entries=None, index_keys=None):
    """One DSA attend of ``length`` tokens of row-seeded inputs; returns the cache and ``[B, H, T, v]``."""
    entries = normal(seed, 2, 1, length, RANK + ROPE) if entries is None else entries
    index_keys = normal(seed + 1, 2, 1, length, INDEX_DIM) if index_keys is None else index_keys
    q = IndexedQueries(queries(seed + 2, 2, length), indexer_queries(seed + 4, 2, length))

    def read(latent_queries, view, q_positions, _):
        return view.attend_latent(latent_queries, q_positions, WEIGHTS, SCALE), None

    return cache.attend(0, q, entries, index_keys, positions, read)


@pytest.mark.parametrize("full_attention", ["static", "dynamic"])
def test_attention_over_the_selection_is_a_dense_mask_of_it(full_attention):
    """A 12-token ragged prefill with top-3: the gathered attention equals expanded attention masked
    to each query's chosen slots; and with at most top-k slots held, every visible token is read."""
    cache = make_cache(full_attention=full_attention)
    positions = cache.next_positions(12, num_new=[12, 9])
    index_keys = normal(31, 2, 1, 12, INDEX_DIM)
    new, out = attend(cache, 30, 12, positions)
    stored = new.layer(0)
    slot_index = np.arange(stored.capacity)
    kv_positions = np.where(slot_index < np.asarray(new.lengths)[:, None], slot_index, -1)
    indexer = indexer_queries(34, 2, 12)
    slots, chosen = select_slots(indexer, stored.index_keys[:, 0], positions, MaskInfo(jnp.asarray(kv_positions)), TOPK)
    selected = np.zeros((2, 12, stored.capacity), bool)
    np.put_along_axis(selected, np.asarray(slots), np.asarray(chosen), axis=-1)
    want = reference(queries(32, 2, 12), stored.latent, positions, kv_positions, selected)
    np.testing.assert_allclose(out, want, atol=1e-5)
    np.testing.assert_array_equal(
        stored.index_keys[:, :, :12], jnp.where(positions[:, None, :, None] >= 0, index_keys, 0)
    )
    few = make_cache(spec=LatentSpec(RANK, ROPE, INDEX_DIM, 4), max_length=4)
    first = few.next_positions(3, num_new=[3, 2])
    _, dense = attend(few, 40, 3, first)
    _, gathered = attend(make_cache(spec=LatentSpec(RANK, ROPE, INDEX_DIM, 4), max_length=8), 40, 3, first)
    np.testing.assert_allclose(dense, gathered, atol=1e-5)


@pytest.mark.parametrize("full_attention", ["static", "dynamic"])
def test_indexer_keys_follow_rollback_reorder_select_and_repeat(full_attention):
    """Rolled back and fed other tokens, the cache attends as one that saw only those; reordered,
    selected and repeated, the indexer keys move with their rows' latents."""
    cache = make_cache(full_attention=full_attention)
    cache, _ = attend(cache, 50, 8, cache.next_positions(8))
    rolled, out = attend(cache.rollback(3), 60, 3, cache.rollback(3).next_positions(3))
    entries, index_keys = cache.layer(0).latent[:, :, :5], cache.layer(0).index_keys[:, :, :5]
    fresh = make_cache(full_attention=full_attention)
    fresh, _ = attend(fresh, 0, 5, fresh.next_positions(5), entries, index_keys)
    fresh, want = attend(fresh, 60, 3, fresh.next_positions(3))
    np.testing.assert_allclose(out, want, atol=1e-6)
    layer = rolled.layer(0)
    edits = (
        (rolled.reorder(jnp.array([1, 0])), [1, 0]),
        (rolled.select(jnp.array([1])), [1]),
        (rolled.repeat(2), [0, 0, 1, 1]),
    )
    for edited, rows in edits:
        moved = edited.layer(0)
        np.testing.assert_array_equal(moved.index_keys, layer.index_keys[jnp.array(rows)])
        np.testing.assert_array_equal(moved.latent, layer.latent[jnp.array(rows)])
        np.testing.assert_array_equal(moved.lengths, layer.lengths[jnp.array(rows)])


def test_updates_name_what_is_wrong():
    latent, indexed = make_cache("latent_attention"), make_cache()
    positions = latent.next_positions(2)
    with pytest.raises(ValueError, match="LatentLayer.update: values must be None"):
        latent.update(0, normal(0, 2, 1, 2, RANK + ROPE), normal(0, 2, 1, 2, RANK + ROPE), positions)
    with pytest.raises(
        ValueError, match=r"keys has shape \(2, 1, 2, 11\), expected \[B, 1, T, R \+ P\] = \[2, 1, T, 12\]"
    ):
        latent.update(0, normal(0, 2, 1, 2, 11), None, positions)
    with pytest.raises(ValueError, match=r"IndexedLayer.update: values is None, expected \[B, 1, T, D_I\]"):
        indexed.update(0, normal(0, 2, 1, 2, RANK + ROPE), None, positions)
    with pytest.raises(ValueError, match="need latent=LatentSpec"):
        Cache.from_layer_types(["indexed_attention"], batch_size=1, num_kv_heads=1, head_dim=4, max_length=4)
    with pytest.raises(ValueError, match="index_dim and index_topk"):
        make_cache(spec=LatentSpec(RANK, ROPE))
    with pytest.raises(ValueError, match="rank must be positive"):
        LatentSpec(0, ROPE)
    paged = Cache.from_layer_types(
        ["indexed_attention"], batch_size=1, num_kv_heads=1, head_dim=4, paging=Paging(4, 2, 16), latent=SPEC
    )  # fmt: skip
    with pytest.raises(TypeError, match="PagedIndexedLayer serves the engine's packed batch"):
        attend(paged, 0, 1, jnp.zeros((1, 1), jnp.int32))


@pytest.mark.parametrize("kind", ["latent_attention", "indexed_attention"])
@pytest.mark.parametrize("full_attention", ["static", "dynamic"])
def test_bytes_equal_the_formula(kind, full_attention):
    """``layer_bytes`` (the registry's formula) equals the allocated layer, 13 tokens stored; and
    DeepSeek-V3's 576 latent values a token stand against 32,768 for 128 full K/V heads."""
    cache = make_cache(kind, full_attention, max_length=13).reserve(13)  # dynamic: a bucket of 16
    options = {"batch_size": 2, "seq_len": 13, "num_kv_heads": 1, "head_dim": 4, "dtype": jnp.float32}
    assert layer_bytes(kind, latent=SPEC, full_attention=full_attention, **options) == cache.layer(0).nbytes
    one_token = {**options, "batch_size": 1, "seq_len": 1}
    assert layer_bytes("latent_attention", latent=LatentSpec(512, 64, 128, 2048), **one_token) - 4 == 576 * 4
    assert 2 * 128 * 128 / 576 == pytest.approx(56.9, abs=0.05)


def test_deepseek_v32_totals_of_the_readme():
    """The README's DeepSeek-V3.2 row: 61 layers of 704 values a token (latent 512, RoPE key 64,
    indexer key 128), bfloat16, at 32k tokens; 128 full heads would need 46.5x more."""
    per_token = 61 * (512 + 64 + 128) * 2
    assert cache_bytes(DEEPSEEK_V32, 1, 32768, jnp.bfloat16) == 32768 * per_token + 61 * 4
    assert cache_bytes(DEEPSEEK_V32, 1, 32768, jnp.bfloat16) / 2**20 == pytest.approx(2684.0, abs=0.05)
    assert 61 * 2 * 128 * 128 * 2 / per_token == pytest.approx(46.5, abs=0.05)


@pytest.mark.parametrize("fmt, tolerance", [("int", 0.03), ("e4m3", 0.1)])
def test_quantized_latent_within_quantization_tolerance_of_the_float_one(fmt, tolerance):
    """``quantization=`` on a static latent layer: 8-bit codes per token in groups of 4 (the latent's
    and the RoPE key's apart); a ragged prefill and a decode step attend within the format's
    tolerance of the float latent (and not equal to it: the codes are read), a rollback forgets
    the decode, and the bytes equal the formula (12 codes + 3 groups' scales a token)."""
    quantization = QuantSpec(nbits=8, format=fmt, q_group_size=4, residual_length=0)
    caches = [make_cache("latent_attention"), make_cache("latent_attention", quantization=quantization)]
    positions = caches[0].next_positions(5, num_new=[5, 3])
    for step, length in enumerate((5, 1)):
        entries, q = normal(10 + step, 2, 1, length, RANK + ROPE), queries(20 + step, 2, length)
        outs = []
        for i, cache in enumerate(caches):
            caches[i], view = cache.update(0, entries, None, positions)
            outs.append(np.asarray(absorbed_attention(q, view, positions, WEIGHTS, SCALE)))
        assert 0 < np.max(np.abs(outs[1] - outs[0])) < tolerance * np.max(np.abs(outs[0]))
        positions = caches[0].next_positions(1)
    assert np.asarray(caches[1].rollback(1).lengths).tolist() == [5, 3]
    scales = 3 * (4 if fmt == "int" else 2)  # float16 scale (and int zero) per group of 4
    options = {"batch_size": 2, "seq_len": 16, "num_kv_heads": 1, "head_dim": 4, "dtype": jnp.float32}
    formula = layer_bytes("latent_attention", latent=SPEC, quantization=quantization, **options)
    assert formula == caches[1].layer(0).nbytes == 2 * 16 * (12 + scales) + 4 * 2


def test_quantized_latent_refusals():
    """A quantized latent needs 8 bits, per-token groups dividing R + P and no residual; DSA, paged
    and dynamic latent layers are not quantized."""
    with pytest.raises(ValueError, match="8-bit per-token codes without a residual"):
        make_cache("latent_attention", quantization=QuantSpec(nbits=4, q_group_size=4, residual_length=0))
    with pytest.raises(ValueError, match="q_group_size 8 must divide R \\+ P = 12"):
        make_cache("latent_attention", quantization=QuantSpec(nbits=8, q_group_size=8, residual_length=0))
    with pytest.raises(ValueError, match="quantization covers static latent_attention layers"):
        make_cache("indexed_attention", quantization=QuantSpec(nbits=8, q_group_size=4, residual_length=0))
