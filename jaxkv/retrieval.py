"""What page retrieval attention (Quest, IceCache) reads, shared by the layer that keeps every token
in its own buffer (``jaxkv.layers.retrieval``) and the engine's page pool (``jaxkv.layers.paged``
with ``Paging.retrieval``): the ``RetrievalSpec``, a page's key summary, the pages' scores for a
query and the pages each query reads. Pure functions over arrays: the layers bring the storage."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from pydantic import ConfigDict

SUMMARIES = ("minmax", "centroid")
PAGE_ORDERS = ("sequential", "clustered")
PREFILLS = ("retrieve", "dense")
_SUMMARY_ROWS = {"minmax": 2, "centroid": 1}  # C: vectors per page summary


@dataclasses.dataclass(frozen=True)
class RetrievalSpec:
    """What a ``RetrievalLayer`` reads per query and K/V head: ``budget`` tokens, of which the
    ``sink`` first pages and the ``recent`` pages up to the query's own always, the rest chosen by
    their ``summary``; each field's docstring says the rest."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # a config key that is no field is an error

    budget: int
    """Tokens each query reads per K/V head (a multiple of ``page_size``)."""
    page_size: int = 16
    """Tokens per page."""
    sink: int = 1
    """The first pages every query reads."""
    recent: int = 1
    """The pages up to the query's own that every query reads (at least 1)."""
    summary: Literal[SUMMARIES] = "minmax"
    """How a page's keys are summarised for scoring: 'minmax' (Quest) or 'centroid'."""
    pages: Literal[PAGE_ORDERS] = "sequential"
    """'sequential' (page i holds positions ``[i·page_size, (i+1)·page_size)``) or 'clustered'
    (``ClusteredRetrievalLayer``: a prefill's pages hold similar keys)."""
    prefill: Literal[PREFILLS] = "retrieve"
    """'retrieve' (every query reads its pages, so any chunking gives token-by-token decoding's
    outputs) or 'dense' (the queries of an update of more than ``page_size`` tokens per row read
    every token: Quest's prefill)."""
    dense_layers: int = 0
    """The model's first N layers read every token at every query (Quest leaves its first two layers
    dense: their attention is not sparse); the others retrieve."""

    def __post_init__(self):
        if self.page_size < 1:
            raise ValueError(f"RetrievalSpec: page_size must be at least 1 token, got {self.page_size}")
        if self.budget < 1 or self.budget % self.page_size:
            raise ValueError(
                f"RetrievalSpec: budget must be a positive multiple of page_size {self.page_size} tokens, got "
                f"{self.budget}"
            )
        if self.sink < 0:
            raise ValueError(f"RetrievalSpec: sink must be >= 0 pages, got {self.sink}")
        if self.recent < 1:
            raise ValueError(f"RetrievalSpec: recent must be at least 1 page (the query's own), got {self.recent}")
        if self.summary not in SUMMARIES:
            raise ValueError(f"RetrievalSpec: summary must be one of {list(SUMMARIES)}, got {self.summary!r}")
        if self.pages not in PAGE_ORDERS:
            raise ValueError(f"RetrievalSpec: pages must be one of {list(PAGE_ORDERS)}, got {self.pages!r}")
        if self.prefill not in PREFILLS:
            raise ValueError(f"RetrievalSpec: prefill must be one of {list(PREFILLS)}, got {self.prefill!r}")
        if self.dense_layers < 0:
            raise ValueError(f"RetrievalSpec: dense_layers must be >= 0 layers, got {self.dense_layers}")
        if self.sink + self.recent > self.budget_pages:
            raise ValueError(
                f"RetrievalSpec: {self.sink} sink + {self.recent} recent pages are always read but the budget is "
                f"{self.budget_pages} pages ({self.budget} tokens); give a larger budget or fewer pages"
            )

    @property
    def budget_pages(self) -> int:
        return self.budget // self.page_size

    @property
    def summary_rows(self) -> int:
        """C: the vectors of one page's summary (2 for minmax, 1 for the centroid)."""
        return _SUMMARY_ROWS[self.summary]

    @property
    def chosen_pages(self) -> int:
        """Pages each query chooses by score (the budget less the sink and recent pages)."""
        return self.budget_pages - self.sink - self.recent


def page_summary(kind: str, page_keys: jax.Array, filled: jax.Array) -> jax.Array:
    """Summaries ``[B, n, H_kv, C, D]`` of pages' keys ``[B, n, page, H_kv, D]`` (float32), over the
    slots ``filled`` (``[B, n, page, 1, 1]``; at least one per page that is kept)."""
    if kind == "minmax":
        low = jnp.min(jnp.where(filled, page_keys, jnp.inf), axis=2)
        high = jnp.max(jnp.where(filled, page_keys, -jnp.inf), axis=2)
        return jnp.stack([low, high], axis=-2)
    total = jnp.sum(jnp.where(filled, page_keys, 0.0), axis=2)
    return (total / jnp.maximum(jnp.sum(filled, axis=2), 1))[..., None, :]


def page_scores(kind: str, grouped: jax.Array, summaries: jax.Array) -> jax.Array:
    """Scores ``[B, H_kv, T, P]`` (float32) of pages summarized by ``summaries`` ``[B, H_kv, P, C, D]``
    for queries ``grouped`` ``[B, H_kv, G, T, D]``: per query head Quest's bound on ``q . k``
    (``minmax``) or ``q . mean`` (``centroid``), the largest over the G query heads of a K/V head."""
    q = grouped.astype(jnp.float32)
    summaries = summaries.astype(jnp.float32)
    if kind == "minmax":
        score = jnp.einsum("bhgtd,bhpd->bhgtp", jnp.minimum(q, 0.0), summaries[..., 0, :])
        score += jnp.einsum("bhgtd,bhpd->bhgtp", jnp.maximum(q, 0.0), summaries[..., 1, :])
    else:
        score = jnp.einsum("bhgtd,bhpd->bhgtp", q, summaries[..., 0, :])
    return jnp.max(score, axis=2)


def attended_pages(spec: RetrievalSpec, scores: jax.Array, q_positions: jax.Array) -> jax.Array:
    """The pages ``[B, H_kv, T, A]`` (-1: none) each query at ``q_positions`` ``[B, T]`` reads, given
    the ``scores`` ``[B, H_kv, T, P]`` of every page: the sink pages, the recent pages up to its own
    (those not among the sink) and the best scored of the complete pages in between.
    ``A = sink + recent + min(chosen_pages, P)``."""
    batch, heads, length, num_pages = scores.shape
    own = (q_positions // spec.page_size)[:, None, :, None]  # [B, 1, T, 1]; a padding query: -1
    sink = jnp.broadcast_to(jnp.arange(spec.sink, dtype=jnp.int32), (batch, heads, length, spec.sink))
    recent = own - spec.recent + 1 + jnp.arange(spec.recent, dtype=jnp.int32)
    recent = jnp.broadcast_to(jnp.where(recent >= spec.sink, recent, -1), (batch, heads, length, spec.recent))
    count = min(spec.chosen_pages, num_pages)
    if count == 0:
        return jnp.concatenate([sink, recent], axis=-1)
    page = jnp.arange(num_pages, dtype=jnp.int32)
    candidate = (page >= spec.sink) & (page <= own - spec.recent)
    best, chosen = jax.lax.top_k(jnp.where(candidate, scores, -jnp.inf), count)
    chosen = jnp.where(best > -jnp.inf, chosen, -1)
    return jnp.concatenate([sink, recent, chosen.astype(jnp.int32)], axis=-1)
