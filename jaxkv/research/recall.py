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
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import LAYER_TYPES, Cache, LayerSpec
from jaxkv.layers.retrieval import RETRIEVAL_LAYERS
from jaxkv.retrieval import RetrievalSpec
from jaxkv.layers.static import StaticLayer
from jaxkv.protocol import CacheLayer, pytree_class
from jaxkv.sharding import BATCH, HEAD_DIM, Q_HEADS, Axes

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
    num_kv_heads, num_tokens, _ = heads.keys.shape
    pages, held = _chosen_pages(jnp.asarray(heads.keys)[None], jnp.asarray(heads.queries)[None, :, None, :], spec)
    held = np.asarray(held).reshape(num_kv_heads, -1, spec.page_size)  # [H_kv, P, page]
    read = np.zeros((num_kv_heads, num_tokens), bool)
    for head, head_pages in enumerate(np.asarray(pages)):
        chosen = held[head, head_pages[head_pages >= 0]].reshape(-1)
        read[head, chosen[chosen >= 0]] = True
    return read


@functools.partial(jax.jit, static_argnames="spec")
def _chosen_pages(keys: jax.Array, queries: jax.Array, spec: RetrievalSpec) -> tuple[jax.Array, jax.Array]:
    """``read_positions``' layer run: the pages ``[H_kv, A]`` the query ``[1, H_q, 1, D]`` at position
    S - 1 reads of ``keys`` ``[1, H_kv, S, D]``, and the position each slot holds ``[H_kv, S]``."""
    _, num_kv_heads, num_tokens, head_dim = keys.shape
    layer = RETRIEVAL_LAYERS[spec.pages].create(1, num_kv_heads, head_dim, num_tokens, spec)
    positions = jnp.arange(num_tokens, dtype=jnp.int32)[None]
    layer, _ = layer.update(keys[:, :, :-1], jnp.zeros_like(keys[:, :, :-1]), positions[:, :-1])
    _, view = layer.update(keys[:, :, -1:], jnp.zeros_like(keys[:, :, -1:]), positions[:, -1:])
    return view.pages(queries, positions[:, -1:])[0, :, 0], view.mask_info.kv_positions[0]


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


@dataclasses.dataclass(frozen=True)
class QueryRecorder:
    """A ``layer_builder`` (``jaxkv.cache.LayerBuilder``) whose full-attention layers are static
    layers that also keep each row's last query (``QueryRecordingLayer``), so that a model's real
    keys and the query after them can be measured (``recorded_heads``); other types as usual."""

    num_query_heads: int

    def build(self, layer_type: str, spec: LayerSpec) -> CacheLayer:
        if layer_type != "full_attention":
            return LAYER_TYPES[layer_type].build(spec)
        if spec.max_length is None:
            raise ValueError("QueryRecorder: pass max_length (its layers are static)")
        return QueryRecordingLayer.create(
            spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.max_length, spec.dtype, self.num_query_heads
        )


@pytree_class
class QueryRecordingLayer(StaticLayer):
    """``StaticLayer`` that keeps the query of each row's last position of its latest update: ``[B, H_q, D]``."""

    queries: jax.Array  # [B, H_q, D]

    @classmethod
    def create(cls, batch_size, num_kv_heads, head_dim, max_length, dtype=jnp.float32, num_query_heads: int = 1):
        static = StaticLayer.create(batch_size, num_kv_heads, head_dim, max_length, dtype)
        queries = jnp.zeros((batch_size, num_query_heads, head_dim), dtype)
        return cls(static.keys, static.values, static.lengths, queries)

    def logical_axes(self):
        return super().logical_axes().replace(queries=Axes(BATCH, Q_HEADS, HEAD_DIM))

    def attend_entry(self, index, queries, keys, values, positions, read):
        stack, out = super().attend_entry(index, queries, keys, values, positions, read)
        last = jnp.argmax(positions, axis=1)  # [B]: each row's last position
        recorded = jnp.take_along_axis(queries, last[:, None, None, None], axis=2)[:, :, 0]
        return stack.replace(queries=stack.queries.at[index].set(recorded.astype(stack.queries.dtype))), out


def recorded_heads(cache: Cache, row: int = 0) -> list[Heads]:
    """Per model layer with a ``QueryRecordingLayer``: row ``row``'s keys (its whole length) and the
    query at its last position."""
    heads = []
    for layer in cache.layers:
        if isinstance(layer, QueryRecordingLayer):
            length = int(layer.lengths[row])
            keys = np.asarray(layer.keys[row, :, :length], np.float32)
            heads.append(Heads(keys, np.asarray(layer.queries[row], np.float32)))
    return heads
