"""Issue 42's recall measure (``jaxkv.research.recall``): 1 when the budget covers every page; below
it, a share in [0, 1] that keys sorted by cluster, or pages the layer clusters itself at prefill,
raise well above mixed sequential pages, for both summaries; and it is the mass of exactly the
positions the layer's pages hold; the query recorder behind the real-key measure keeps each row's
last query and its keys."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import Cache
from jaxkv.attention import cached_attention
from jaxkv.retrieval import RetrievalSpec
from jaxkv.research.recall import QueryRecorder, page_recall, read_positions, recorded_heads, synthetic_keys

TOKENS, PAGE = 256, 8
DRAW = {"num_kv_heads": 2, "group": 2, "head_dim": 16, "num_clusters": 8}


@pytest.mark.parametrize("summary", ["minmax", "centroid"])
def test_recall_is_one_at_a_full_budget_and_clustering_raises_it_below(summary):
    mixed = synthetic_keys(0, TOKENS, layout="mixed", **DRAW)
    ordered = synthetic_keys(0, TOKENS, layout="sorted", **DRAW)
    for pages in ("sequential", "clustered"):
        np.testing.assert_allclose(page_recall(mixed, RetrievalSpec(TOKENS, PAGE, summary=summary, pages=pages)), 1.0)
    small = RetrievalSpec(32, PAGE, summary=summary)  # 4 of 32 pages: sink, own page and 2 chosen
    low, high = page_recall(mixed, small), page_recall(ordered, small)
    clustered = page_recall(mixed, RetrievalSpec(32, PAGE, summary=summary, pages="clustered"))
    for recall in (low, high, clustered):
        assert np.all((recall >= 0) & (recall <= 1))
    assert high.mean() > 0.5 and high.mean() > 2 * low.mean() and clustered.mean() > 2 * low.mean()


def test_recall_counts_the_mass_of_the_positions_the_layer_reads():
    """The pages are the layer's (sink 0, the query's own page 31, two others per K/V head), and the
    recall is the chosen pages' share of the top-k mass, recomputed here."""
    heads = synthetic_keys(1, TOKENS, layout="sorted", **DRAW)
    spec = RetrievalSpec(32, PAGE)
    read = read_positions(heads, spec)
    assert read.shape == (2, TOKENS) and np.all(read.sum(-1) == 32) and np.all(read[:, :PAGE] & read[:, -PAGE:])
    q, k = heads.queries[0].astype(np.float64), heads.keys[0].astype(np.float64)
    p = np.exp(k @ q / 4.0 - np.max(k @ q / 4.0))
    p /= p.sum()
    top = np.argsort(-p)[:32]
    np.testing.assert_allclose(page_recall(heads, spec)[0], p[top][read[0, top]].sum() / p[top].sum(), rtol=1e-6)


def test_query_recorder_keeps_each_rows_last_query_and_its_keys():
    """The recording layer (a model's real keys and query, ``scripts/retrieval_recall.py --model``):
    after an update of ragged rows, each row's query at its last position and its keys."""
    cache = Cache.from_layer_types(
        ["full_attention"], batch_size=2, num_kv_heads=2, head_dim=8, max_length=16, layer_builder=QueryRecorder(4)
    )
    q, k, v = (np.random.default_rng(i).normal(size=(2, h, 6, 8)).astype(np.float32) for i, h in enumerate((4, 2, 2)))
    positions = jnp.asarray([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, -1, -1]], jnp.int32)
    cache, _ = cached_attention(cache, 0, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), positions)
    first, second = recorded_heads(cache, 0)[0], recorded_heads(cache, 1)[0]
    np.testing.assert_array_equal(first.queries, q[0, :, 5])
    np.testing.assert_array_equal(second.queries, q[1, :, 3])
    np.testing.assert_array_equal(second.keys, k[1, :, :4])
