"""Masks from slot positions, and a reference attention that reads a layer's ``KVView``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.protocol import MaskInfo


def attention_mask(q_positions: jax.Array, mask_info: MaskInfo) -> jax.Array:
    """``[B, T, S]`` bool: may the query at ``q_positions`` ``[B, T]`` see each slot?

    Only absolute positions decide: the slot must hold a token (``kv_positions >= 0``),
    not from the future (causal), inside the window or the same chunk when the layer has
    one. A padding query (negative position) sees nothing. Prefill and decode take the
    same path.
    """
    q = q_positions[:, :, None]
    kv = mask_info.kv_positions[:, None, :]
    mask = (kv >= 0) & (q >= 0) & (kv <= q)
    if mask_info.window is not None:
        mask &= kv > q - mask_info.window
    if mask_info.chunk is not None:
        mask &= kv // mask_info.chunk == q // mask_info.chunk
    return mask


def attention(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask_info: MaskInfo,
    q_positions: jax.Array,
    *,
    scale: float | None = None,
    logit_softcap: float | None = None,
) -> jax.Array:
    """Softmax attention of ``queries`` ``[B, H_q, T, D]`` over a layer's K/V ``[B, H_kv, S, D]``.

    GQA/MQA: ``H_q`` is a multiple of ``H_kv``; query head h reads K/V head
    ``h // (H_q / H_kv)``. ``scale`` defaults to ``D ** -0.5``; ``logit_softcap`` applies
    ``c * tanh(logits / c)`` (Gemma 2). Logits and softmax run in float32. A query that
    may see no slot (padding) gets zeros, not NaN. Returns ``[B, H_q, T, D]``.
    """
    batch, num_heads, length, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"attention: {num_heads} query heads is not a multiple of {num_kv_heads} K/V heads")
    scale = head_dim**-0.5 if scale is None else scale
    grouped = queries.reshape(batch, num_kv_heads, num_heads // num_kv_heads, length, head_dim)
    logits = jnp.einsum("bhgtd,bhsd->bhgts", grouped, keys, preferred_element_type=jnp.float32) * scale
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    mask = attention_mask(q_positions, mask_info)[:, None, None]
    logits = jnp.where(mask, logits, -jnp.inf)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
    weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    out = jnp.einsum("bhgts,bhsd->bhgtd", weights.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return out.reshape(batch, num_heads, length, head_dim).astype(queries.dtype)
