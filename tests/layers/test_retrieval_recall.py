"""Issue 42's recall measure (``jaxkv.research.recall``): 1 when the budget covers every page; below
it, a share in [0, 1] that clustered pages raise well above sequential ones, for both summaries,
and that is the mass of exactly the pages the layer reads."""

import numpy as np
import pytest

from jaxkv.layers.retrieval import RetrievalSpec
from jaxkv.research.recall import chosen_pages, page_recall, synthetic_keys

TOKENS, PAGE = 256, 8
DRAW = {"num_kv_heads": 2, "group": 2, "head_dim": 16, "num_clusters": 8}


@pytest.mark.parametrize("summary", ["minmax", "centroid"])
def test_recall_is_one_at_a_full_budget_and_clustered_pages_raise_it_below(summary):
    sequential = synthetic_keys(0, TOKENS, layout="sequential", **DRAW)
    clustered = synthetic_keys(0, TOKENS, layout="clustered", **DRAW)
    full = RetrievalSpec(TOKENS, PAGE, summary=summary)
    for heads in (sequential, clustered):
        np.testing.assert_allclose(page_recall(heads, full), 1.0)
    small = RetrievalSpec(32, PAGE, summary=summary)  # 4 of 32 pages: sink, own page and 2 chosen
    low, high = page_recall(sequential, small), page_recall(clustered, small)
    assert np.all((low >= 0) & (low <= 1)) and np.all((high >= 0) & (high <= 1))
    assert high.mean() > 0.5 and high.mean() > 2 * low.mean()


def test_recall_counts_the_mass_of_the_pages_the_layer_reads():
    """The pages are the layer's (sink 0, the query's own page 31, two others per K/V head), and the
    recall is the chosen pages' share of the top-k mass, recomputed here."""
    heads = synthetic_keys(1, TOKENS, layout="clustered", **DRAW)
    spec = RetrievalSpec(32, PAGE)
    pages = chosen_pages(heads, spec)
    assert pages.shape == (2, 4) and np.all(pages[:, :2] == [0, 31]) and np.all(pages[:, 2:] > 0)
    q, k = heads.queries[0].astype(np.float64), heads.keys[0].astype(np.float64)
    p = np.exp(k @ q / 4.0 - np.max(k @ q / 4.0))
    p /= p.sum()
    top = np.argsort(-p)[:32]
    read = np.isin(top // PAGE, pages[0])
    np.testing.assert_allclose(page_recall(heads, spec)[0], p[top][read].sum() / p[top].sum(), rtol=1e-6)
