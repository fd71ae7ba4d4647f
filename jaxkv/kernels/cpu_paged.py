"""The native CPU paged-attention kernel (``jaxkv/kernels/cpu/paged_attention.cc``, XLA FFI target
``jaxkv_JaxkvPagedAttention``): query blocks over jaxkv's stacked page pools, read in place.

One call reads layer ``index`` of the K and V stacks exactly as jaxkv stores them, ``[L, P, page,
H_kv, D]`` ('tokens' layout) or ``[L, P, H_kv, page, D]`` ('heads'), float32 / bfloat16 / float16
values or quantized codes (``QuantizedTensor``: int codes of 2, 4 or 8 bits with a float16 scale and
zero point per token, head and group; fp8 codes with a scale), through each query block's block
table: nothing of the pool is gathered or copied per step. A query at position q reads the slots of
positions ``0 .. q`` (``q - window + 1 .. q`` with a sliding window) whose pages are not the null
page, as jaxkv's XLA read masks them. GQA: each (block, K/V head) reads its pages once for its G
query heads; online softmax in float32; parallel over (block, K/V head) on XLA's intra-op thread
pool, a block's slots split into partitions merged after when blocks * heads leave threads idle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.kernels import native
from jaxkv.quantization import QuantSpec

SYMBOL = "JaxkvPagedAttention"
# Fewest slots of a partition: a block's slots are split only when blocks * K/V heads are fewer than
# twice the pool's threads (plus the caller). SmolLM2-shaped decode (3 K/V heads, 2 threads), batch 1,
# best of 200: 4096 slots 0.54 ms whole, 0.39-0.46 ms split; 1024 slots no gain (0.125 / 0.129 ms).
MIN_PARTITION = 1024


def target() -> str | None:
    """The kernel's FFI target name, or None when the native kernels are off (``jaxkv.kernels.native``).
    A library without the kernel's symbol raises (AttributeError): a stale build, not an absent one."""
    return native.target(SYMBOL)


def available() -> bool:
    """Whether the kernel can run here (the native library is loaded and has it)."""
    return target() is not None


def _stack_operands(stack, quantization: QuantSpec | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A stack's operands: its values or codes (fp8 codes as their float8 dtype: a bitcast), and its
    scales and zero points (``[0]`` float16 when absent)."""
    none = jnp.zeros((0,), jnp.float16)
    if quantization is None:
        return stack, none, none
    codes = stack.codes
    if not quantization.asymmetric:
        codes = jax.lax.bitcast_convert_type(codes, quantization.number_dtype)
    zeros = none if stack.zeros is None else stack.zeros.astype(jnp.float16)
    return codes, stack.scales.astype(jnp.float16), zeros


def paged_attention(
    queries: jax.Array, positions: jax.Array, key_stack, value_stack, index, tables: jax.Array, *, scale: float,
    logit_softcap: float | None = None, window: int | None = None, quantization: QuantSpec | None = None,
    heads_layout: bool = False, min_partition: int = MIN_PARTITION,
) -> jax.Array:  # fmt: skip
    """Attention of query blocks ``queries`` ``[Z, Q, H_q, D]`` at ``positions`` ``[Z, Q]`` (-1:
    padding, which reads nothing and gets zeros) over layer ``index`` of ``key_stack`` /
    ``value_stack`` (``[L, P, page, H_kv, D]``, or ``[L, P, H_kv, page, D]`` with ``heads_layout``;
    a ``QuantizedTensor`` under ``quantization``, per-token groups), block z through block table
    ``tables[z]`` ``[Z, W]``. Logits are ``q . k * scale``, then capped (``logit_softcap``); a query
    at q sees positions ``> q - window`` when ``window``. Returns ``[Z, Q, H_q, D]`` float32."""
    name = target()
    if name is None:
        raise RuntimeError("the native CPU kernels are off (jaxkv.kernels.native): no CPU paged attention")
    keys, key_scales, key_zeros = _stack_operands(key_stack, quantization)
    values, value_scales, value_zeros = _stack_operands(value_stack, quantization)
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(queries.shape, jnp.float32))
    return call(
        queries.astype(jnp.float32), positions.astype(jnp.int32), tables.astype(jnp.int32),
        jnp.asarray(index, jnp.int32), keys, values, key_scales, value_scales, key_zeros, value_zeros,
        scale=np.float32(scale), softcap=np.float32(logit_softcap or 0.0), window=np.int64(window or 0),
        heads_layout=bool(heads_layout), bits=np.int64(quantization.bits if quantization is not None else 0),
        min_partition=np.int64(min_partition),
    )  # fmt: skip
