"""MLA's latent entries and DSA's indexer keys in the engine's page pools (``jaxkv.mla.LatentPages``):
a tiny random DeepSeek-V3.2 (every layer DSA, contexts past ``index_topk``) served with prefix
caching, staggered arrivals and a pool too small for every admitted request (preemptions, swapped
to the host tier and back) gives ``generate``'s greedy tokens; the pages' bytes follow the
formula; a step reads the rows' pages up to the furthest query's page block only; what the paged
layers refuse is refused by name."""

import jax.numpy as jnp
import numpy as np
import pytest
from jaxkv.models.deepseek_v32 import DeepseekV32, DeepseekV32Config

from jaxkv.batch import PackedBatch
from jaxkv.cache import Cache
from jaxkv.layers.indexed import IndexerQueries, PagedIndexedLayer, paged_select, select_slots
from jaxkv.layers.latent import PagedLatentLayer
from jaxkv.layers.paged import Paging, block_pages
from jaxkv.mla import LatentQueries, LatentSpec, LatentView, LatentWeights, absorbed_attention
from jaxkv.protocol import MaskInfo
from jaxkv.serving import Engine
from tests.cases import greedy_reference, run_arrivals

VOCAB, TOPK, NEW_TOKENS = 97, 8, 10
CONFIG = DeepseekV32Config(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=12, index_topk=TOPK, index_head_dim=16, index_n_heads=4,
    max_position_embeddings=256, layer_types=("indexed_attention",) * 2,
)  # fmt: skip
PAGE_BYTES = 2 * 4 * (16 + 8 + 16) * 4  # two layers, 4 slots of latent + rope key + indexer key, float32


def test_engine_with_prefix_cache_preemption_and_swap_equals_generate():
    """Five requests sharing a 13-token prefix, arriving at steps 0 to 8, in a pool of 10 pages
    (three rows need up to 24): prefix hits, preemptions swapped out and in, every page back at
    the end, and ``generate``'s greedy tokens."""
    model = DeepseekV32(CONFIG)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, VOCAB, 13).tolist()
    prompts = [prefix + rng.integers(0, VOCAB, n).tolist() for n in (3, 6, 1, 9, 4)]
    engine = Engine(
        model, kv_memory=10 * PAGE_BYTES, page_size=4, max_num_seqs=3, max_num_batched_tokens=16, max_model_len=48,
        preemption="swap", host_kv_memory=64 * PAGE_BYTES,
    )  # fmt: skip
    assert engine.sizes.full_page_bytes == PAGE_BYTES and engine.sizes.state_bytes == 0
    got = run_arrivals(engine, prompts, [0, 2, 2, 5, 8], NEW_TOKENS)
    stats = engine.stats()
    assert stats.prefix_cache.hit_rate > 0 and stats.preemptions > 0 and stats.swaps > 0, stats
    assert got == greedy_reference(model, prompts, NEW_TOKENS)
    for pool in engine.kv.pools:
        pool.manager.check()


SPEC = LatentSpec(4, 2, 3, 2)
PAGING = Paging(page_size=2, num_pages=5, max_length=8)


@pytest.mark.parametrize("kind, cls, width", [("latent_attention", PagedLatentLayer, 6),
                                              ("indexed_attention", PagedIndexedLayer, 9)])  # fmt: skip
def test_pages_and_their_bytes(kind, cls, width):
    """Under ``paging`` the registry builds the paged class, its pages ``[P, page, 1, ·]`` of the
    full pool, and its formula counts them (rows of whole pages plus the null page)."""
    cache = Cache.from_layer_types([kind], batch_size=1, num_kv_heads=1, head_dim=4, paging=PAGING, latent=SPEC)
    layer = cache.layer(0)
    assert type(layer) is cls and layer.pool == "full" and layer.latent_pages.shape == (5, 2, 1, 6)
    assert cls.kv_bytes(2, 3, 1, 4, jnp.float32, page_size=2, latent=SPEC) == (2 * 2 + 1) * 2 * width * 4
    assert layer.nbytes == 5 * 2 * width * 4


def test_refusals_name_the_cause():
    """Written outside the engine, values for a latent layer, none for DSA, or compacted rows: each refused."""
    latent = Cache.from_layer_types(["latent_attention"], batch_size=1, num_kv_heads=1, head_dim=4, paging=PAGING,
                                    latent=SPEC)  # fmt: skip
    entries = jnp.zeros((1, 1, 2, 6))
    with pytest.raises(TypeError, match="PagedLatentLayer is written by the serving engine's packed batch"):
        latent.update(0, entries, None, jnp.zeros((1, 2), jnp.int32))
    tables, rows, positions = (
        {"full": jnp.ones((1, 4), jnp.int32)},
        jnp.zeros(2, jnp.int32),
        jnp.zeros((1, 2), jnp.int32),
    )
    packed = PackedBatch(rows, tables, decode_tokens=0, tokens_per_row=2)
    with pytest.raises(ValueError, match="values must be None"):
        latent.layer(0).attend_packed_entry(0, None, entries, entries, positions, None, packed)
    shifted = PackedBatch(rows, tables, decode_tokens=0, tokens_per_row=2, shifts={"full": jnp.zeros(1, jnp.int32)})
    with pytest.raises(ValueError, match="compacted rows"):
        latent.layer(0).attend_packed_entry(0, None, entries, None, positions, None, shifted)
    with pytest.raises(ValueError, match="compaction does not cover latent pages"):
        latent.layer(0).page_scores(jnp.zeros((1, 1), jnp.int32))


def rows_over_two_page_blocks(seed: int, dim: int):
    """A pool ``[1, P, 4, 1, dim]`` (entry 0) of random entries, two rows whose tables map two page
    blocks (2 x 32 pages of 4 slots) to pages of their own, the second block's pages all NaN, and
    queries at positions 5 and 100 (both in the first block)."""
    rng = np.random.default_rng(seed)
    pages = block_pages(4)
    table = jnp.asarray(1 + np.arange(2 * 2 * pages).reshape(2, 2 * pages), jnp.int32)
    pool = rng.normal(size=(1, 1 + 4 * pages, 4, 1, dim)).astype(np.float32)
    pool[0, np.asarray(table[:, pages:]).ravel()] = np.nan
    return jnp.asarray(pool), table, jnp.asarray([[5], [100]], jnp.int32), pages * 4


def test_latent_rows_are_read_up_to_the_furthest_querys_page_block():
    """``PagedLatentView``: the absorbed form over the rows' pages equals it over the first block's
    slots gathered by hand, and never reads the second block (its pages hold NaN)."""
    rank, rope, heads, nope, value = 6, 2, 3, 4, 5
    pool, table, q_positions, span = rows_over_two_page_blocks(0, rank + rope)
    layer = PagedLatentLayer(latent_pages=pool)
    view = layer.rows_view(0, table, q_positions)
    assert view.shape == (2, 1, 2 * span, rank + rope) and int(view.mask_info.slots_used) == 101
    rng = np.random.default_rng(1)
    weights = LatentWeights(jnp.asarray(rng.normal(size=(heads, nope + value, rank)), jnp.float32), nope)
    queries = LatentQueries(*(jnp.asarray(rng.normal(size=(2, heads, 1, d)), jnp.float32) for d in (nope, rope)))
    got = absorbed_attention(queries, view, q_positions, weights, 0.5)
    entries = pool[0, table[:, : span // 4]].reshape(2, 1, span, rank + rope)
    dense = LatentView(entries[None], entries[None], 0, MaskInfo(jnp.broadcast_to(jnp.arange(span), (2, span))))
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(got, absorbed_attention(queries, dense, q_positions, weights, 0.5), rtol=1e-5)


def test_dsa_selects_over_filled_page_blocks_as_over_every_slot():
    """``paged_select`` (a running top-k over page blocks up to the furthest query's) chooses what one
    ``top_k`` over the visible slots chooses, ties included (a row scoring every slot 0), and never
    reads the second block (its indexer keys are NaN)."""
    index_dim, heads, topk = 4, 2, 8
    pool, table, q_positions, span = rows_over_two_page_blocks(2, index_dim)
    keys = PagedLatentLayer(latent_pages=pool).rows_view(0, table, q_positions)
    rng = np.random.default_rng(3)
    # row 1 scores every slot 0: all ties, the lowest slots chosen
    indexer = IndexerQueries(
        jnp.asarray(rng.normal(size=(2, 1, heads, index_dim)), jnp.float32),
        jnp.asarray(np.abs(rng.normal(size=(2, 1, heads))) * [[[1.0]], [[0.0]]], jnp.float32),
    )  # fmt: skip
    slots, chosen = paged_select(indexer, keys, q_positions, topk)
    first = pool[0, table[:, : span // 4]].reshape(2, span, index_dim)
    mask_info = MaskInfo(jnp.broadcast_to(jnp.arange(span), (2, span)))
    want, want_chosen = select_slots(indexer, first, q_positions, mask_info, topk)
    np.testing.assert_array_equal(chosen.sum(-1), [[6], [topk]])  # the row at position 5 sees 6 slots
    for row in range(2):
        assert set(np.asarray(slots[row, 0])[chosen[row, 0]]) == set(np.asarray(want[row, 0])[want_chosen[row, 0]])
    assert set(np.asarray(slots[1, 0]).tolist()) == set(range(topk))
