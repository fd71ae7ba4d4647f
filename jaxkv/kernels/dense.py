"""jaxkv's dense full-attention buffers read by GPU kernels: decode tokens by JAX's Pallas GPU
decode kernel (``jax.experimental.pallas.ops.gpu.decode_attention``), prefills by cuDNN's fused
attention (``jax.nn.dot_product_attention(implementation="cudnn")``): ``generate``'s caches, no pages.

A static layer's slot p holds position p, so a decode query at position q of a row holding
``length`` tokens sees exactly slots ``0 .. min(length, q + 1) - 1``: the kernel's
``kv_seq_len``. The buffer ``[B, H_kv, S, D]`` is read in place (the kernel's GQA entry swaps its
``[B, S, H_kv, D]`` argument back to this layout, so the two swaps cancel). What it lacks goes to
XLA (``dense_route``).

A prefill's mask is jaxkv's own (``[B, T, S]``, from positions: a fresh prompt and a continued
cache put the causal diagonal in different places), handed to cuDNN as its mask; cuDNN takes
float16 and bfloat16 only. Off a GPU the same call runs ``jax.nn.dot_product_attention``'s XLA
implementation (the check on CPU, as interpret mode is for the Pallas kernel).

Under a mesh (``sharding``) XLA does not partition either call: each runs per device under
``shard_map``, over its rows (``batch``) and its K/V heads with their query heads (``kv_heads``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.decode_attention import gqa
from jax.sharding import PartitionSpec

from jaxkv.kernels.backends import CPU, PALLAS_GPU, PALLAS_TPU, XLA, interpreted
from jaxkv.sharding import BATCH, HEAD_DIM, KV_HEADS, KV_SLOTS, Axes, Layout

# The kernel splits the buffer into K splits (the most of K_SPLITS) of a multiple of MIN_SPLIT
# slots each, read in blocks of the most of BLOCK_SIZES that divides a split.
K_SPLITS, MIN_SPLIT, BLOCK_SIZES = (16, 8, 4, 2, 1), 16, (128, 64, 32, 16)
HALF_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))  # what cuDNN's attention takes


def dense_route(
    backend: str, *, num_queries: int, num_slots: int, dtype, logit_softcap, slot_mass: bool
) -> str | None:  # fmt: skip
    """Why a static layer's queries are read by XLA under ``backend``; None: a kernel reads them
    (one query per row: the decode kernel; more: cuDNN). ``num_queries``: query tokens per row;
    ``num_slots``: the buffer's capacity S; ``dtype``: the buffer's."""
    if backend == XLA:
        return "the xla backend"
    if backend == PALLAS_TPU:
        return "no Pallas TPU kernel for dense buffers"
    if backend == CPU:
        return "the CPU kernel reads paged pools only"
    if logit_softcap is not None:
        return "logit soft-capping (neither the decode kernel nor cuDNN's attention has it)"
    if slot_mass:
        return "slot scores (query_weights)"
    if num_queries == 1 and num_slots % MIN_SPLIT:
        return f"a buffer of {num_slots} slots (the decode kernel splits it in multiples of {MIN_SPLIT})"
    if num_queries > 1 and not interpreted(PALLAS_GPU) and jnp.dtype(dtype) not in HALF_DTYPES:
        return f"a {jnp.dtype(dtype).name} prefill (cuDNN's attention takes float16 or bfloat16)"
    return None


def per_device(sharding: Layout | None, call, queries: jax.Array, keys: jax.Array, values: jax.Array, rows):
    """``call(queries, keys, values, rows)`` (``queries`` ``[B, H_q, ...]``, ``keys``/``values``
    ``[B, H_kv, S, D]``, ``rows`` ``[B, ...]``, returning ``queries``' shape) as is without a
    ``sharding``, else per device under ``shard_map``: rows and heads split as the buffer is."""
    if sharding is None:
        return call(queries, keys, values, rows)
    batch, heads, _, _ = sharding.spec(Axes(BATCH, KV_HEADS, KV_SLOTS, HEAD_DIM), keys.shape, quiet=True)
    buffer = PartitionSpec(batch, heads)
    split = jax.shard_map(
        call, mesh=sharding.mesh, in_specs=(buffer, buffer, buffer, PartitionSpec(batch)), out_specs=buffer,
        check_vma=False,
    )  # fmt: skip
    return split(queries, keys, values, rows)


def dense_prefill(
    queries: jax.Array, keys: jax.Array, values: jax.Array, mask: jax.Array, *, scale: float,
    sharding: Layout | None = None,
) -> jax.Array:  # fmt: skip
    """Attention of ``queries`` ``[B, H_q, T, D]`` over ``keys``/``values`` ``[B, H_kv, S, D]`` under
    ``mask`` ``[B, T, S]`` (jaxkv's: ``jaxkv.softmax.attention_mask``) by cuDNN on a GPU, else by
    ``jax.nn.dot_product_attention``'s XLA implementation; a query that sees nothing gets zeros.
    Returns ``[B, H_q, T, D]`` float32. ``sharding``: see ``per_device``."""

    def call(queries, keys, values, mask):
        out = jax.nn.dot_product_attention(
            queries.astype(keys.dtype).swapaxes(1, 2), keys.swapaxes(1, 2), values.swapaxes(1, 2),
            mask=mask[:, None], scale=scale, implementation="xla" if interpreted(PALLAS_GPU) else "cudnn",
        )  # fmt: skip
        seen = jnp.any(mask, axis=-1)[:, None, :, None]  # [B, 1, T, 1]
        return jnp.where(seen, out.swapaxes(1, 2).astype(jnp.float32), 0.0)

    return per_device(sharding, call, queries, keys, values, mask)


def dense_decode(
    backend: str, queries: jax.Array, keys: jax.Array, values: jax.Array, kv_lengths: jax.Array, *, scale: float,
    sharding: Layout | None = None,
) -> jax.Array:  # fmt: skip
    """Decode attention by ``backend``'s kernel: ``queries`` ``[B, H_q, D]`` (one token per row) over
    slots ``0 .. kv_lengths[b] - 1`` ``[B]`` of ``keys``/``values`` ``[B, H_kv, S, D]`` (length 0:
    zeros). Returns ``[B, H_q, D]`` float32. ``sharding``: see ``per_device``."""
    if backend != PALLAS_GPU:
        raise ValueError(f"dense_decode: backend must be {PALLAS_GPU!r}, got {backend!r}")
    num_slots = keys.shape[2]
    splits = next(s for s in K_SPLITS if num_slots % (s * MIN_SPLIT) == 0)
    block = next(b for b in BLOCK_SIZES if (num_slots // splits) % b == 0)

    def call(queries, keys, values, kv_lengths):
        out = gqa(
            queries.astype(keys.dtype), keys.swapaxes(1, 2), values.swapaxes(1, 2), kv_seq_len=kv_lengths,
            sm_scale=scale, block_k=block, k_splits=splits, interpret=interpreted(PALLAS_GPU),
        )  # fmt: skip
        return jnp.where(kv_lengths[:, None, None] > 0, out.astype(jnp.float32), 0.0)

    return per_device(sharding, call, queries, keys, values, kv_lengths.astype(jnp.int32))
