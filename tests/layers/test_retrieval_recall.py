"""Issue 42's recall measure (``jaxkv.research.recall``): 1 when the budget covers every page; below
it, a share in [0, 1] that keys sorted by cluster, or pages the layer clusters itself at prefill,
raise well above mixed sequential pages, for both summaries; and it is the mass of exactly the
positions the layer's pages hold."""

import numpy as np
import pytest

from jaxkv.layers.retrieval import RetrievalSpec
from jaxkv.research.recall import page_recall, read_positions, synthetic_keys

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
