"""jaxkv's page pools in the argument layout of JAX's Pallas paged-attention decode kernels.

jaxkv keeps a layer's pages ``[P, page_size, H_kv, D]`` (K and V apart; quantized: codes and
float16 scales ``[P, page_size, H_kv, D/G]``); both decode kernels want ``[H_kv, P, page_size, D]``
and one scale per token and head ``[H_kv, P, page_size]``. ``heads_major`` transposes a layer's
pool per call: the cost a pool stored heads-major would remove (docs/kernels.md).

What the kernels read: one query token per row, slots ``0 .. length - 1`` of the row's block
table (a length, no mask), K/V of float dtype or scaled codes (``x * scale``, no zero point),
logit soft-capping. What they lack goes to jaxkv's XLA path (``kernel_route``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import MAX_INT8
from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import QuantizedTensor as TpuQuantized

from jaxkv.kernels.backends import PALLAS_GPU, PALLAS_TPU, XLA, interpreted
from jaxkv.quantization import QuantSpec

# Pages per compute block and K splits of the GPU kernel (its defaults), pages per compute
# block of the TPU kernel; fewer when a block table is narrower.
GPU_PAGES_PER_BLOCK, GPU_K_SPLITS, TPU_PAGES_PER_BLOCK = 8, 16, 8
# Block-table padding columns point at page 0: past every row's length, never read.
PADDING_PAGE = 0


def heads_major(pool: jax.Array) -> jax.Array:
    """A layer's pool ``[P, page_size, H_kv, ·]`` in the kernels' layout ``[H_kv, P, page_size, ·]``."""
    return pool.transpose(2, 0, 1, 3)


def kernel_route(
    backend: str, *, window: int | None, decode_width: int, shifted: bool, slot_mass: bool,
    quantization: QuantSpec | None, head_dim: int,
) -> str | None:  # fmt: skip
    """Why a paged view's decode tokens are read by XLA under ``backend``; None: the kernel reads
    them. Prefill chunks always go to XLA (the decode kernels take one query token per row)."""
    if backend == XLA:
        return "the xla backend"
    if window is not None:
        return "a sliding window (the kernels read slots 0 .. length - 1, and freed pages leave holes)"
    if decode_width != 1:
        return "verified drafts (several query tokens per row)"
    if shifted:
        return "compacted rows (their slots hold non-contiguous positions)"
    if slot_mass:
        return "slot scores (query_weights)"
    if quantization is not None and (quantization.asymmetric or quantization.q_group_size != head_dim):
        return "int codes (a zero point) or several scale groups per token (the kernels take one scale per token)"
    return None


def paged_decode(
    backend: str, queries: jax.Array, keys, values, tables: jax.Array, lengths: jax.Array, *, scale: float,
    logit_softcap: float | None = None, quantization: QuantSpec | None = None,
) -> jax.Array:  # fmt: skip
    """Decode attention by ``backend``'s kernel over a layer's pool as jaxkv stores it: ``keys``/
    ``values`` ``[P, page_size, H_kv, D]`` (a ``QuantizedTensor`` under ``quantization``: fp8 codes
    with one scale per token, see ``kernel_route``), transposed to the kernels' layout here. See
    ``kernel_decode`` for the rest. Returns ``[B, H_q, D]`` float32."""
    (k_pages, k_scales), (v_pages, v_scales) = _kernel_pages(keys, quantization), _kernel_pages(values, quantization)
    return kernel_decode(
        backend, queries, k_pages, v_pages, tables, lengths, scale=scale, logit_softcap=logit_softcap,
        k_scales=k_scales, v_scales=v_scales,
    )  # fmt: skip


def kernel_decode(
    backend: str, queries: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array, lengths: jax.Array,
    *, scale: float, logit_softcap: float | None = None, k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
    """Decode attention by ``backend``'s kernel over pages in its own layout: ``queries``
    ``[B, H_q, D]`` (one token per row) over ``k_pages``/``v_pages`` ``[H_kv, P, page_size, D]``
    (float, or codes with ``k_scales``/``v_scales`` ``[H_kv, P, page_size]``: value = code * scale),
    row b reading slots ``0 .. lengths[b] - 1`` ``[B]`` through block table ``tables[b]`` ``[B, W]``
    (length 0: zeros). ``scale`` multiplies the logits, then ``logit_softcap`` caps them.
    Returns ``[B, H_q, D]`` float32."""
    q = queries.astype(jnp.float32) * scale
    q = q if k_scales is not None else q.astype(k_pages.dtype)  # scaled codes are cast to the query's dtype
    lengths = lengths.astype(jnp.int32)
    if backend == PALLAS_GPU:
        out = _gpu_decode(q, k_pages, v_pages, tables, lengths, k_scales, v_scales, logit_softcap)
    elif backend == PALLAS_TPU:
        out = _tpu_decode(q, k_pages, v_pages, tables, lengths, k_scales, v_scales, logit_softcap)
    else:
        raise ValueError(f"kernel_decode: backend must be {PALLAS_GPU!r} or {PALLAS_TPU!r}, got {backend!r}")
    return out.astype(jnp.float32)


def _kernel_pages(pool, quantization: QuantSpec | None) -> tuple[jax.Array, jax.Array | None]:
    """A pool in the kernels' layout: pages ``[H_kv, P, page_size, D]`` and, quantized, the scale
    of each token ``[H_kv, P, page_size]`` float32 (fp8 codes as their float8 dtype)."""
    if quantization is None:
        return heads_major(pool), None
    codes = jax.lax.bitcast_convert_type(pool.codes, quantization.number_dtype)
    return heads_major(codes), heads_major(pool.scales)[..., 0].astype(jnp.float32)


def _padded(tables: jax.Array, multiple: int) -> jax.Array:
    """``tables`` ``[B, W]`` with padding columns up to a multiple of ``multiple``."""
    extra = -tables.shape[1] % multiple
    return jnp.pad(tables, ((0, 0), (0, extra)), constant_values=PADDING_PAGE)


def _gpu_decode(q, k_pages, v_pages, tables, lengths, k_scales, v_scales, logit_softcap) -> jax.Array:
    """The Pallas GPU kernel (split-K over ``GPU_K_SPLITS`` partitions of the table at most)."""
    per_block = min(GPU_PAGES_PER_BLOCK, tables.shape[1])
    splits = min(GPU_K_SPLITS, -(-tables.shape[1] // per_block))
    return gpu_paged_attention(
        q, k_pages, v_pages, _padded(tables, splits * per_block), lengths, k_scales, v_scales,
        pages_per_compute_block=per_block, k_splits=splits, attn_logits_soft_cap=logit_softcap,
        interpret=interpreted(PALLAS_GPU),
    )  # fmt: skip


def _tpu_decode(q, k_pages, v_pages, tables, lengths, k_scales, v_scales, logit_softcap) -> jax.Array:
    """The Pallas TPU kernel: K/V dequantized to bfloat16 inside it (its scales are absolute
    maxima: ``x * h / 127.5``, so jaxkv's scale ``s`` is passed as ``s * 127.5``)."""
    if k_scales is not None:
        k_pages = TpuQuantized(k_pages, k_scales[..., None] * MAX_INT8)
        v_pages = TpuQuantized(v_pages, v_scales[..., None] * MAX_INT8)
    per_block = min(TPU_PAGES_PER_BLOCK, tables.shape[1])

    def call():
        return tpu_paged_attention(
            q, k_pages, v_pages, lengths, _padded(tables, per_block), pages_per_compute_block=per_block,
            attn_logits_soft_cap=logit_softcap,
        )  # fmt: skip

    if not interpreted(PALLAS_TPU):
        return call()
    with pltpu.force_tpu_interpret_mode():
        return call()
