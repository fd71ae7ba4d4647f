"""Attention as model code calls it: ``attention`` over the view a cache update returned (the
view reads itself: ``KVView.attend``, ``PagedKVView.attend``), and ``cached_attention``, the
one line a model's attention layer calls."""

from __future__ import annotations

import jax

from jaxkv.batch import PackedBatch
from jaxkv.cache import Cache
from jaxkv.protocol import KVView
from jaxkv.softmax import attention_block_size, attention_mask

__all__ = ["attention", "attention_block_size", "attention_mask", "cached_attention"]


def attention(
    queries: jax.Array,
    kv: KVView,
    q_positions: jax.Array,
    *,
    scale: float | None = None,
    logit_softcap: float | None = None,
    block_size: int | None = None,
    query_weights: jax.Array | None = None,
):
    """Softmax attention of ``queries`` ``[B, H_q, T, D]`` at ``q_positions`` ``[B, T]`` over
    the K/V ``[B, H_kv, S, D]`` of the view a cache update returned.

    GQA/MQA: ``H_q`` is a multiple of ``H_kv``; query head h reads K/V head
    ``h // (H_q / H_kv)``. ``scale`` defaults to ``D ** -0.5``; ``logit_softcap`` applies
    ``c * tanh(logits / c)`` (Gemma 2). Logits and softmax run in float32. A query that
    may see no slot (padding) gets zeros, not NaN. Returns ``[B, H_q, T, D]``; with
    ``query_weights`` ``[B, T]`` (or ``[B, T, K]``), ``(output, slot mass [B, H_kv, S]``
    (``[B, H_kv, S, K]``)``)`` (see ``jaxkv.softmax.read_whole``), from the same softmax: the
    scores an evicting layer ranks its slots by.

    The view decides how it is read (``kv.attend``): a plain view block by block up to its
    filled slots (``jaxkv.softmax.dense_attention``), a paged view page block by page block
    through its block table. ``block_size``: slots per block of a plain view's read.
    """
    scale = queries.shape[-1] ** -0.5 if scale is None else scale
    options = dict(scale=scale, logit_softcap=logit_softcap, block_size=block_size, query_weights=query_weights)
    return kv.attend(queries, q_positions, **options)


def cached_attention(
    cache: Cache,
    layer_idx,
    queries: jax.Array,
    keys: jax.Array | None,
    values: jax.Array | None,
    positions: jax.Array,
    *,
    scale: float | None = None,
    logit_softcap: float | None = None,
    packed: PackedBatch | None = None,
) -> tuple[Cache, jax.Array]:
    """The one line a model's attention layer calls: store ``keys``/``values`` ``[B, H_kv, T, D]``
    of layer ``layer_idx`` at ``positions`` ``[B, T]`` and attend ``queries`` ``[B, H_q, T, D]``
    over what the layer holds (``attention``'s ``scale`` and ``logit_softcap``). Returns the
    cache and the output ``[B, H_q, T, D]``. An evicting layer also receives the slot mass its
    policy scores by, from the same softmax. ``packed``: a serving step's packed batch
    (``jaxkv.batch``), for the layers that read it. A layer that reuses an earlier layer's K/V
    (``Cache.kv_sources``: Gemma 4) passes ``keys = values = None``."""

    options = dict(scale=scale, logit_softcap=logit_softcap)

    def read(queries, view, positions, query_weights):
        if query_weights is None:
            return attention(queries, view, positions, **options), None
        return attention(queries, view, positions, **options, query_weights=query_weights)

    return cache.attend(layer_idx, queries, keys, values, positions, read, packed)
