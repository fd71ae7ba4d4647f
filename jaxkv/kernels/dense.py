"""jaxkv's dense full-attention buffers read by JAX's Pallas GPU decode kernel
(``jax.experimental.pallas.ops.gpu.decode_attention``): ``generate``'s caches, no pages.

A static layer's slot p holds position p, so a decode query at position q of a row holding
``length`` tokens sees exactly slots ``0 .. min(length, q + 1) - 1``: the kernel's
``kv_seq_len``. The buffer ``[B, H_kv, S, D]`` is read in place (the kernel's GQA entry swaps its
``[B, S, H_kv, D]`` argument back to this layout, so the two swaps cancel). What it lacks goes to
XLA (``dense_route``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu.decode_attention import gqa

from jaxkv.kernels.backends import PALLAS_GPU, PALLAS_TPU, XLA, interpreted

# The kernel splits the buffer into K splits (the most of K_SPLITS) of a multiple of MIN_SPLIT
# slots each, read in blocks of the most of BLOCK_SIZES that divides a split.
K_SPLITS, MIN_SPLIT, BLOCK_SIZES = (16, 8, 4, 2, 1), 16, (128, 64, 32, 16)


def dense_route(backend: str, *, num_queries: int, num_slots: int, logit_softcap, slot_mass: bool) -> str | None:
    """Why a static layer's queries are read by XLA under ``backend``; None: the GPU decode kernel
    reads them. ``num_queries``: query tokens per row; ``num_slots``: the buffer's capacity S."""
    if backend == XLA:
        return "the xla backend"
    if backend == PALLAS_TPU:
        return "no Pallas TPU kernel for dense buffers"
    if num_queries != 1:
        return "several query tokens per row (a prefill): the decode kernel takes one"
    if logit_softcap is not None:
        return "logit soft-capping (the dense decode kernel has none)"
    if slot_mass:
        return "slot scores (query_weights)"
    if num_slots % MIN_SPLIT:
        return f"a buffer of {num_slots} slots (the kernel splits it in multiples of {MIN_SPLIT})"
    return None


def dense_decode(
    backend: str, queries: jax.Array, keys: jax.Array, values: jax.Array, kv_lengths: jax.Array, *, scale: float
) -> jax.Array:
    """Decode attention by ``backend``'s kernel: ``queries`` ``[B, H_q, D]`` (one token per row) over
    slots ``0 .. kv_lengths[b] - 1`` ``[B]`` of ``keys``/``values`` ``[B, H_kv, S, D]`` (length 0:
    zeros). Returns ``[B, H_q, D]`` float32."""
    if backend != PALLAS_GPU:
        raise ValueError(f"dense_decode: backend must be {PALLAS_GPU!r}, got {backend!r}")
    num_slots = keys.shape[2]
    splits = next(s for s in K_SPLITS if num_slots % (s * MIN_SPLIT) == 0)
    block = next(b for b in BLOCK_SIZES if (num_slots // splits) % b == 0)
    kv_lengths = kv_lengths.astype(jnp.int32)
    out = gqa(
        queries.astype(keys.dtype), keys.swapaxes(1, 2), values.swapaxes(1, 2), kv_seq_len=kv_lengths, sm_scale=scale,
        block_k=block, k_splits=splits, interpret=interpreted(PALLAS_GPU),
    )  # fmt: skip
    return jnp.where(kv_lengths[:, None, None] > 0, out.astype(jnp.float32), 0.0)
