"""How much of the attention a page retrieval budget keeps (issue 42's recall): for a query, the
fraction of the attention mass of its true top-k keys (k = the budget in tokens, the most a budget
could hold) that lies in the pages a retrieval layer chooses (``RetrievalView.pages``, the layer's
own choice), per query head.

``synthetic_keys`` draws keys around cluster centres and queries aimed at one cluster each, with
the tokens in random cluster order (``mixed``: sequential pages mix clusters) or sorted by cluster
(``sorted``: sequential pages hold one cluster, the best that clustering pages could give). A
``RetrievalSpec(pages="clustered")`` layer clusters mixed keys into pages itself at prefill.
``scripts/retrieval_recall.py`` prints the table of budgets x summaries x layouts.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxkv.layers.retrieval import RETRIEVAL_LAYERS, RetrievalSpec

LAYOUTS = ("mixed", "sorted")


@dataclasses.dataclass(frozen=True)
class Heads:
    """One row's keys ``[H_kv, S, D]`` and the queries ``[H_q, D]`` of the step after them (float32)."""

    keys: np.ndarray
    queries: np.ndarray


def synthetic_keys(
    seed: int, num_tokens: int, *, num_kv_heads: int = 2, group: int = 2, head_dim: int = 64, num_clusters: int = 32,
    spread: float = 0.5, layout: str = "mixed",
) -> Heads:  # fmt: skip
    """Keys of ``num_clusters`` clusters per K/V head (unit-variance centres, noise of ``spread``),
    ``group`` queries per K/V head, each a cluster's centre plus noise of ``spread``; ``layout``
    orders the tokens (see the module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"synthetic_keys: layout must be one of {list(LAYOUTS)}, got {layout!r}")
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(num_kv_heads, num_clusters, head_dim))
    clusters = rng.integers(0, num_clusters, size=(num_kv_heads, num_tokens))
    if layout == "sorted":
        clusters = np.sort(clusters, axis=-1)
    heads = np.arange(num_kv_heads)[:, None]
    keys = centres[heads, clusters] + spread * rng.normal(size=(num_kv_heads, num_tokens, head_dim))
    aimed = rng.integers(0, num_clusters, size=(num_kv_heads, group))
    queries = centres[heads, aimed] + spread * rng.normal(size=(num_kv_heads, group, head_dim))
    return Heads(keys.astype(np.float32), queries.reshape(num_kv_heads * group, head_dim).astype(np.float32))


def read_positions(heads: Heads, spec: RetrievalSpec) -> np.ndarray:
    """``[H_kv, S]`` bool: the positions held by the pages that the query step after ``heads.keys``
    reads through a retrieval layer of ``spec``: keys 0..S-2 prefilled in one update (a clustered
    layer clusters them), key S-1 fed with the query, which sits at position S - 1."""
    num_kv_heads, num_tokens, head_dim = heads.keys.shape
    layer = RETRIEVAL_LAYERS[spec.pages].create(1, num_kv_heads, head_dim, num_tokens, spec)
    keys = jnp.asarray(heads.keys)[None]
    positions = jnp.arange(num_tokens, dtype=jnp.int32)[None]
    layer, _ = layer.update(keys[:, :, :-1], jnp.zeros_like(keys[:, :, :-1]), positions[:, :-1])
    _, view = layer.update(keys[:, :, -1:], jnp.zeros_like(keys[:, :, -1:]), positions[:, -1:])
    pages = np.asarray(view.pages(jnp.asarray(heads.queries)[None, :, None, :], positions[:, -1:])[0, :, 0])
    held = np.asarray(view.mask_info.kv_positions[0]).reshape(num_kv_heads, -1, spec.page_size)  # [H_kv, P, page]
    read = np.zeros((num_kv_heads, num_tokens), bool)
    for head, head_pages in enumerate(pages):
        chosen = held[head, head_pages[head_pages >= 0]].reshape(-1)
        read[head, chosen[chosen >= 0]] = True
    return read


def page_recall(heads: Heads, spec: RetrievalSpec) -> np.ndarray:
    """``[H_q]``: per query head, the share of its top-``spec.budget`` keys' attention mass (softmax of
    ``q . k / sqrt(D)`` over every key) that the chosen pages hold. 1 when the budget covers every page."""
    num_kv_heads, _, head_dim = heads.keys.shape
    group = heads.queries.shape[0] // num_kv_heads
    keys = np.repeat(heads.keys, group, axis=0).astype(np.float64)  # [H_q, S, D]
    logits = np.einsum("hsd,hd->hs", keys, heads.queries) / np.sqrt(head_dim)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    probabilities = weights / weights.sum(-1, keepdims=True)
    top = np.argsort(-probabilities, axis=-1)[:, : spec.budget]  # [H_q, k]
    covered = np.take_along_axis(np.repeat(read_positions(heads, spec), group, axis=0), top, axis=-1)
    mass = np.take_along_axis(probabilities, top, axis=-1)
    return (mass * covered).sum(-1) / mass.sum(-1)
