"""Softmax attention over a layer's slots: masks from slot positions, the online softmax, and
the reader of a plain ``KVView`` (``dense_attention``). Views call it from their ``attend``
method (``jaxkv.protocol.KVView.attend``); a paged view reads its pages with the same mask and
online softmax (``jaxkv.layers.paged.PagedKVView.attend``). Model code calls
``jaxkv.attention.attention`` / ``cached_attention``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from jaxkv.protocol import KVView, MaskInfo


def attention_mask(q_positions: jax.Array, mask_info: MaskInfo) -> jax.Array:
    """``[B, T, S]`` bool: may the query at ``q_positions`` ``[B, T]`` see each slot?
    ``[B, H_kv, T, S]`` when ``kv_positions`` is per K/V head (``[B, H_kv, S]``: an evicting layer).

    Only absolute positions decide: the slot must hold a token (``kv_positions >= 0``),
    not from the future (causal), inside the window or the same chunk when the layer has
    one. A padding query (negative position) sees nothing. Prefill and decode take the
    same path.
    """
    q, kv = q_positions[:, :, None], mask_info.kv_positions[..., None, :]
    if kv.ndim == 4:  # per K/V head
        q = q[:, None]
    mask = (kv >= 0) & (q >= 0) & (kv <= q)
    if mask_info.window is not None:
        mask &= kv > q - mask_info.window
    if mask_info.chunk is not None:
        mask &= kv // mask_info.chunk == q // mask_info.chunk
    return mask


# Slots per block read. Each block costs a copy out of the stack, a batched dot and a loop
# iteration (about 10 us per layer on this CPU), so big blocks suit long caches and small
# ones let a short cache skip its empty tail: the largest power of two <= 512 that still
# splits the buffer into 4 blocks, at least 64 (measured on SmolLM2-shaped decode steps,
# batch 1 and 8: capacity 512 read as 128-slot blocks costs 0.3-0.6x reading it whole at
# 32-160 of 512 filled and the same when full; 512-slot blocks fastest at 4096 of 8192).
ATTENTION_BLOCK = 512
MIN_ATTENTION_BLOCK = 64


def attention_block_size(num_slots: int) -> int:
    """The block length ``attention`` reads a ``num_slots`` buffer in (see ATTENTION_BLOCK)."""
    size = ATTENTION_BLOCK
    while size > MIN_ATTENTION_BLOCK and num_slots < 4 * size:
        size //= 2
    return size


@dataclasses.dataclass(frozen=True)
class Queries:
    """The query side of one ``attention`` call: ``queries`` ``[B, H_q, T, D]`` at ``positions``
    ``[B, T]``, grouped ``[B, H_kv, G, T, D]`` by the K/V head they read (G per head).
    ``per_kv_head``: how one query is scored, see ``per_head`` (``for_view`` sets it)."""

    queries: jax.Array
    grouped: jax.Array
    positions: jax.Array
    mask_info: MaskInfo
    scale: float
    logit_softcap: float | None
    per_kv_head: bool = False

    @property
    def one_query(self) -> bool:
        """One query of one row (a batch-1 decode step): scored head by head, see ``per_head``."""
        return self.queries.shape[0] * self.queries.shape[2] == 1

    def for_view(self, kv: KVView) -> Queries:
        """These queries set to read ``kv``: its blocks are products of K/V heads when its
        reads compute them (``KVView.computed_reads``), else of query heads."""
        return dataclasses.replace(self, per_kv_head=kv.computed_reads)

    def per_head(self, product, rows: jax.Array, kv_block: jax.Array) -> jax.Array:
        """``product(rows of one head, its K/V head [S, D])`` for every head, stacked as the
        batched einsum's output ``[1, H_kv, G, 1, X]``; ``rows`` ``[H_q, 1, Y]`` hold one query's.

        A matrix-vector product per query head, written ``q @ K.T`` with K ``[S, D]``, is the
        form XLA's CPU backend fuses with the slice of the stacked cache; the batched einsum
        copies the block and transposes its keys. A block the view computes (dequantizes) is
        fused into each product that reads it, so there it is one product per K/V head
        (its G query rows together): G times less dequantization, measured 1.5x faster on
        an int4 decode step, and 1.3x slower on a plain one.
        """
        _, num_kv_heads, group, _, _ = self.grouped.shape
        if self.per_kv_head:
            parts = [product(rows[h * group : (h + 1) * group, 0], kv_block[0, h]) for h in range(num_kv_heads)]
        else:
            parts = [product(rows[h], kv_block[0, h // group]) for h in range(num_kv_heads * group)]
        return jnp.stack(parts).reshape(1, num_kv_heads, group, 1, -1)

    def scores(self, k_block: jax.Array, positions_block: jax.Array) -> jax.Array:
        """Masked logits ``[B, H_kv, G, T, S]`` (float32) over keys ``[B, H_kv, S, D]`` holding
        ``positions_block`` ``[B, S]``; -inf where the mask refuses."""
        if self.one_query:
            product = lambda q, k: jnp.matmul(q, k.T, preferred_element_type=jnp.float32)
            logits = self.per_head(product, self.queries[0], k_block) * self.scale
        else:
            logits = jnp.einsum("bhgtd,bhsd->bhgts", self.grouped, k_block, preferred_element_type=jnp.float32)
            logits = logits * self.scale
        if self.logit_softcap is not None:
            logits = self.logit_softcap * jnp.tanh(logits / self.logit_softcap)
        mask = attention_mask(self.positions, self.mask_info.replace(kv_positions=positions_block))
        mask = mask[:, None, None] if mask.ndim == 3 else mask[:, :, None]  # -> [B, H_kv or 1, 1, T, S]
        return jnp.where(mask, logits, -jnp.inf)

    def weighted(self, weights: jax.Array, v_block: jax.Array) -> jax.Array:
        """``weights`` ``[B, H_kv, G, T, S]`` times values ``[B, H_kv, S, D]``: ``[B, H_kv, G, T, D]`` float32."""
        if self.one_query:
            product = lambda w, v: jnp.matmul(w.astype(v.dtype), v, preferred_element_type=jnp.float32)
            return self.per_head(product, weights.reshape(self.queries.shape[1], 1, -1), v_block)
        weights = weights.astype(v_block.dtype)
        return jnp.einsum("bhgts,bhsd->bhgtd", weights, v_block, preferred_element_type=jnp.float32)


def read_whole(q: Queries, kv: KVView, query_weights: jax.Array | None = None):
    """Softmax numerator and denominator over the view's whole buffer: the weighted values
    ``[B, H_kv, G, T, D]`` and the weight totals ``[B, H_kv, G, T, 1]``; with ``query_weights``
    ``[B, T]``, also the slot mass ``[B, H_kv, S]``: each slot's attention probability summed
    over the query heads of its K/V head and over the queries, query t weighted by
    ``query_weights[:, t]`` (what an evicting layer's policy scores by). Weights ``[B, T, K]``
    give K masses ``[B, H_kv, S, K]`` from the one softmax (two eviction scorings from one pass)."""
    q = q.for_view(kv)
    logits = q.scores(kv.keys, kv.mask_info.kv_positions)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    if query_weights is None:
        return q.weighted(weights, kv.values), total
    probabilities = weights / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
    mass = jnp.einsum("bhgts,bt...->bhs...", probabilities, query_weights.astype(jnp.float32))
    return q.weighted(weights, kv.values), total, mass


def softmax_init(shape: tuple[int, ...], head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An online softmax's empty carry for queries ``shape`` (``[..., T]``): running max, total, weighted values."""
    return (
        jnp.full((*shape, 1), -jnp.inf, jnp.float32),
        jnp.zeros((*shape, 1), jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )


def softmax_step(carry, logits: jax.Array, weigh) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block of an online softmax: ``logits`` ``[..., S]`` (-inf where masked) folded into the
    running ``(max, total, weighted values)``; ``weigh(weights)`` gives the block's weighted values."""
    peak, total, acc = carry
    new_peak = jnp.maximum(peak, jnp.max(logits, axis=-1, keepdims=True))
    safe_peak = jnp.where(jnp.isfinite(new_peak), new_peak, 0.0)
    rescale = jnp.exp(peak - safe_peak)
    weights = jnp.exp(logits - safe_peak)
    total = total * rescale + jnp.sum(weights, axis=-1, keepdims=True)
    return new_peak, total, acc * rescale + weigh(weights)


def read_blocked(q: Queries, kv: KVView, block_size: int) -> tuple[jax.Array, jax.Array]:
    """``read_whole``'s result by an online softmax over blocks of ``block_size`` slots up to
    ``mask_info.slots_used`` of the view's body, then over its tail (``KVView.split_tail``):
    running max, running total, running weighted values."""
    body, tail = kv.split_tail()
    mask_info = body.mask_info

    def fold(reader: Queries, carry, k_block, v_block, positions):
        scores = reader.scores(k_block, positions)
        return softmax_step(carry, scores, lambda weights: reader.weighted(weights, v_block))

    def step(block, carry):
        start = block * block_size
        positions = jax.lax.dynamic_slice_in_dim(mask_info.kv_positions, start, block_size, axis=-1)
        return fold(q.for_view(body), carry, *body.read(start, block_size), positions)

    init = softmax_init(q.grouped.shape[:-1], q.grouped.shape[-1])  # [B, H_kv, G, T]
    num_blocks = (mask_info.slots_used + block_size - 1) // block_size
    carry = jax.lax.fori_loop(0, num_blocks, step, init)
    if tail is not None:
        carry = fold(q.for_view(tail), carry, tail.keys, tail.values, tail.mask_info.kv_positions)
    _, total, out = carry
    return out, total


def dense_attention(
    queries: jax.Array,
    kv: KVView,
    q_positions: jax.Array,
    *,
    scale: float,
    logit_softcap: float | None = None,
    block_size: int | None = None,
    query_weights: jax.Array | None = None,
):
    """``jaxkv.attention.attention`` over a plain view's slots ``[B, H_kv, S, D]`` (see there).

    When the layer says how many leading slots are in use (``mask_info.slots_used``) and
    the buffer spans several blocks, K/V are read block by block (``kv.read``) up to that
    count with an online softmax: cost follows the filled length, not the capacity, and
    neither the layer's whole buffer nor a ``[T, S]`` score matrix over it is built.
    ``block_size`` defaults to ``attention_block_size(S)``; a buffer shorter than two
    blocks, or not a multiple of one, is read whole.
    """
    batch, num_heads, length, head_dim = queries.shape
    _, num_kv_heads, num_slots, _ = kv.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"attention: {num_heads} query heads is not a multiple of {num_kv_heads} K/V heads")
    group = num_heads // num_kv_heads  # query heads per K/V head
    q = Queries(
        queries=queries,
        grouped=queries.reshape(batch, num_kv_heads, group, length, head_dim),
        positions=q_positions,
        mask_info=kv.mask_info,
        scale=scale,
        logit_softcap=logit_softcap,
    )

    def output(out: jax.Array, total: jax.Array) -> jax.Array:
        out = out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
        return out.reshape(batch, num_heads, length, head_dim).astype(queries.dtype)

    if query_weights is not None:
        out, total, mass = read_whole(q, kv, query_weights)
        return output(out, total), mass
    block_size = attention_block_size(num_slots) if block_size is None else block_size
    blocked = kv.mask_info.slots_used is not None and num_slots % block_size == 0 and num_slots >= 2 * block_size
    return output(*(read_blocked(q, kv, block_size) if blocked else read_whole(q, kv)))
