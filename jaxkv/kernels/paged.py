"""jaxkv's page pools in the argument layout of JAX's Pallas paged-attention decode kernels.

jaxkv stacks a layer group's pages ``[L, P, page_size, H_kv, D]`` ('tokens' layout, the default)
or ``[L, P, H_kv, page_size, D]`` ('heads': ``Paging.layout``), K and V apart; quantized: codes
and float16 scales ``[..., D/G]``. Both decode kernels want one layer's ``[H_kv, P', page', D]``
and one scale per token and head ``[H_kv, P', page']``.

* In place (``flat_tables``): flattened, a stack is a run of contiguous pages of one K/V head:
  ``[page_size, D]`` tiles of ``(layer, page, head)`` in the 'heads' layout, one-token rows of
  ``(layer, page, slot, head)`` in the 'tokens' layout. The kernel is given that as one K/V head
  ``[1, N, g, D]`` (a reshape, no copy), each (row, K/V head) as a row of its own with its query
  heads, and a block table into the flattened pages. Both kernels read a 'heads' stack this way;
  the GPU kernel reads a 'tokens' stack this way too.
* TPU on the 'tokens' layout: the kernel copies pages into VMEM a page at a time, so one-token
  pages would be one DMA per token; the layer's pool is sliced out and transposed to
  ``[H_kv, P, page_size, D]`` per call (``heads_major``): store the pool 'heads' instead.

What the Pallas kernels read: one query token per row, slots ``0 .. length - 1`` of the row's
block table (a length, no mask), K/V of float dtype or scaled codes (``x * scale``, no zero point),
logit soft-capping. What they lack goes to jaxkv's XLA path (``kernel_route``).

The native CPU kernel (``cpu``: ``jaxkv.kernels.cpu_paged``, ``paged_blocks``) takes the stacks
themselves, either layout, and query blocks of one row with a position per query: decode tokens,
a row's token and its drafts, sliding windows (slots of positions ``> q - window``), null pages
skipped as XLA masks them, and every page format jaxkv stores (int codes with their zero points,
fp8, several scale groups per token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as gpu_paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention
from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import MAX_INT8
from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import QuantizedTensor as TpuQuantized

from jaxkv.kernels import cpu_paged
from jaxkv.kernels.backends import CPU, PALLAS_GPU, PALLAS_TPU, XLA, interpreted
from jaxkv.quantization import QuantizedTensor, QuantSpec
from jaxkv.sharding import HEAD_DIM, KV_HEADS, LAYERS, PAGE_SLOTS, PAGES, Axes, Layout

# Pages per compute block and K splits of the GPU kernel (its defaults), tokens per compute block
# of the GPU kernel over one-token pages (8 pages of 16), pages per compute block of the TPU
# kernel; fewer when a block table is narrower.
GPU_PAGES_PER_BLOCK, GPU_K_SPLITS, GPU_TOKENS_PER_BLOCK, TPU_PAGES_PER_BLOCK = 8, 16, 128, 8
# Block-table padding columns point at page 0: past every row's length, never read.
PADDING_PAGE = 0
# How a layer's pages are stored: [P, page_size, H_kv, D] (a slot's heads together) or
# [P, H_kv, page_size, D] (each head's slots of a page together: the kernels' page tiles).
TOKENS_LAYOUT, HEADS_LAYOUT = "tokens", "heads"
POOL_LAYOUTS = (TOKENS_LAYOUT, HEADS_LAYOUT)


def heads_major(pool: jax.Array) -> jax.Array:
    """A layer's pool ``[P, page_size, H_kv, ·]`` in the kernels' layout ``[H_kv, P, page_size, ·]``."""
    return pool.transpose(2, 0, 1, 3)


def kernel_route(
    backend: str, *, window: int | None, decode_width: int, shifted: bool, slot_mass: bool,
    quantization: QuantSpec | None, head_dim: int, split_pool: bool = False,
) -> str | None:  # fmt: skip
    """Why a paged view's decode tokens are read by XLA under ``backend``; None: the kernel reads
    them. Prefill chunks go to XLA (the Pallas kernels take one query token per row; for the CPU
    kernel see ``prefill_route``). ``split_pool``: the pool is split over devices along more than
    its K/V heads (``split_pool``)."""
    if backend == XLA:
        return "the xla backend"
    if split_pool:
        return "pages split over devices (a row's pages on several devices: its softmax needs a cross-device merge)"
    if backend == CPU:
        return _cpu_route(shifted=shifted, slot_mass=slot_mass)
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


def prefill_route(backend: str, *, shifted: bool, slot_mass: bool, split_pool: bool = False) -> str | None:
    """Why a paged view's prefill chunks (blocks of ``QUERY_BLOCK`` queries of one row) are read by
    XLA under ``backend``; None: the CPU kernel reads them (a 512-token chunk in a third of XLA's
    time: docs/kernels.md, "CPU kernel")."""
    if backend == XLA:
        return "the xla backend"
    if backend != CPU:
        return "the Pallas decode kernels take one query token per row"
    if split_pool:
        return "pages split over devices (a row's pages on several devices: its softmax needs a cross-device merge)"
    return _cpu_route(shifted=shifted, slot_mass=slot_mass)


def _cpu_route(*, shifted: bool, slot_mass: bool) -> str | None:
    """What the CPU kernel lacks (it reads windows, drafts and every page format jaxkv stores)."""
    if shifted:
        return "compacted rows (their slots hold non-contiguous positions, per K/V head)"
    if slot_mass:
        return "slot scores (query_weights: the kernel returns no slot mass)"
    return None


def check_layout(layout: str, argument: str = "layout") -> str:
    """``layout`` if it is one of ``POOL_LAYOUTS``, else a ValueError naming ``argument``."""
    if layout not in POOL_LAYOUTS:
        raise ValueError(f"{argument} must be one of {POOL_LAYOUTS}, got {layout!r}")
    return layout


def slot_and_head_axes(layout: str) -> tuple[int, int]:
    """The axes (from the end) of a pool's page slots and K/V heads in ``layout``: 'tokens' pages
    ``[P, page_size, H_kv, D]``: ``(-3, -2)``; 'heads' pages ``[P, H_kv, page_size, D]``: ``(-2, -3)``."""
    return (-3, -2) if check_layout(layout) == TOKENS_LAYOUT else (-2, -3)


def _stack_spec(sharding: Layout, shape: tuple[int, ...], layout: str) -> PartitionSpec:
    """The mesh ``PartitionSpec`` of a pool stack of ``shape`` ``[L, P, ·, ·, D]`` stored in
    ``layout`` under ``sharding`` (its codes' and its scales' alike: their leading axes agree)."""
    inner = (PAGE_SLOTS, KV_HEADS) if check_layout(layout) == TOKENS_LAYOUT else (KV_HEADS, PAGE_SLOTS)
    return sharding.spec(Axes(LAYERS, PAGES, *inner, HEAD_DIM), shape, quiet=True)


def split_pool(sharding: Layout | None, shape: tuple[int, ...], layout: str) -> bool:
    """Whether ``sharding`` splits a pool stack of ``shape`` over devices along anything but its K/V
    heads (its pages, by default over ``data``): a kernel call per device would see only some of a
    row's pages, so the decode tokens go to XLA (``kernel_route``)."""
    if sharding is None:
        return False
    spec = _stack_spec(sharding, shape, layout)
    head_axis = len(shape) + slot_and_head_axes(layout)[1]
    return any(axis is not None for dim, axis in enumerate(spec) if dim != head_axis)


def paged_decode(
    backend: str, queries: jax.Array, key_stack, value_stack, index, tables: jax.Array, lengths: jax.Array, *,
    scale: float, logit_softcap: float | None = None, quantization: QuantSpec | None = None,
    layout: str = TOKENS_LAYOUT, sharding: Layout | None = None, window: int | None = None,
) -> jax.Array:  # fmt: skip
    """Decode attention by ``backend``'s kernel over layer ``index`` of a pool stack as jaxkv stores
    it: ``key_stack``/``value_stack`` ``[L, P, page_size, H_kv, D]`` (``layout`` 'tokens') or
    ``[L, P, H_kv, page_size, D]`` ('heads'), a ``QuantizedTensor`` under ``quantization`` (fp8
    codes with one scale per token, see ``kernel_route``); ``queries`` ``[B, H_q, D]`` (one token
    per row), row b reading slots ``0 .. lengths[b] - 1`` ``[B]`` through block table ``tables[b]``
    ``[B, W]`` (length 0: zeros); ``window`` (the CPU kernel only): the last ``window`` of them.
    Returns ``[B, H_q, D]`` float32.

    ``sharding``: the mesh and rules the stacks are sharded by. XLA does not partition a kernel
    call, so the kernel runs per device under ``shard_map``, each device over its own K/V heads
    and their query heads; a pool split otherwise (``split_pool``) is refused: route it to XLA."""
    if backend == CPU:
        return paged_blocks(
            queries[:, None], (lengths - 1)[:, None], key_stack, value_stack, index, tables, scale=scale,
            logit_softcap=logit_softcap, window=window, quantization=quantization, layout=layout, sharding=sharding,
        )[:, 0]  # fmt: skip
    if window is not None:
        raise ValueError(f"paged_decode: the {backend} kernel reads no sliding window (kernel_route routes it to XLA)")
    if sharding is not None:
        def local(queries, key_stack, value_stack, index, tables, lengths):
            return paged_decode(
                backend, queries, key_stack, value_stack, index, tables, lengths, scale=scale,
                logit_softcap=logit_softcap, quantization=quantization, layout=layout,
            )  # fmt: skip

        return _per_device(sharding, layout, local, queries, key_stack, value_stack, index, tables, lengths)
    options = {"scale": scale, "logit_softcap": logit_softcap}
    if backend == PALLAS_GPU or layout == HEADS_LAYOUT:
        stacks = (key_stack, value_stack)
        return _in_place_decode(backend, queries, stacks, index, tables, lengths, quantization, layout, options)
    (k_pages, k_scales), (v_pages, v_scales) = (
        _kernel_pages(jax.tree.map(lambda leaf: leaf[index], stack), quantization) for stack in (key_stack, value_stack)
    )  # fmt: skip
    return kernel_decode(
        backend, queries, k_pages, v_pages, tables, lengths, k_scales=k_scales, v_scales=v_scales, **options
    )


def paged_blocks(
    queries: jax.Array, positions: jax.Array, key_stack, value_stack, index, tables: jax.Array, *, scale: float,
    logit_softcap: float | None = None, window: int | None = None, quantization: QuantSpec | None = None,
    layout: str = TOKENS_LAYOUT, sharding: Layout | None = None,
) -> jax.Array:  # fmt: skip
    """Attention of query blocks by the CPU kernel (``jaxkv.kernels.cpu_paged``) over layer ``index``
    of the stacks as ``paged_decode`` takes them: block z's queries ``queries[z]`` ``[Z, Q, H_q, D]`` at
    ``positions[z]`` ``[Z, Q]`` (-1: padding, zeros) read their row's slots of positions ``0 .. q``
    (within ``window``) through block table ``tables[z]`` ``[Z, W]``, causal among the block's own
    tokens. Returns ``[Z, Q, H_q, D]`` float32. Under ``sharding``, per device as ``paged_decode``."""
    if sharding is not None:
        def local(queries, key_stack, value_stack, index, positions, tables):
            return paged_blocks(
                queries, positions, key_stack, value_stack, index, tables, scale=scale, logit_softcap=logit_softcap,
                window=window, quantization=quantization, layout=layout,
            )  # fmt: skip

        return _per_device(sharding, layout, local, queries, key_stack, value_stack, index, positions, tables)
    return cpu_paged.paged_attention(
        queries, positions, key_stack, value_stack, index, tables, scale=scale, logit_softcap=logit_softcap,
        window=window, quantization=quantization, heads_layout=check_layout(layout) == HEADS_LAYOUT,
    )  # fmt: skip


def _per_device(sharding: Layout, layout: str, local, queries, key_stack, value_stack, index, *rows) -> jax.Array:
    """``local(queries, key_stack, value_stack, index, *rows)`` per device under ``shard_map``: the
    stacks' K/V heads and the query heads of ``queries`` ``[..., H_q, D]`` (their axis -2) split as the
    stacks are, ``index`` and ``rows`` (block tables, lengths, positions) replicated. Returns
    ``queries``' shape."""
    shape = (key_stack.codes if isinstance(key_stack, QuantizedTensor) else key_stack).shape
    if split_pool(sharding, shape, layout):
        raise ValueError(f"paged_decode: {sharding.mesh.shape} splits the pool {shape} along more than its K/V heads")
    pool = _stack_spec(sharding, shape, layout)
    head = pool[len(shape) + slot_and_head_axes(layout)[1]]
    heads = PartitionSpec(*([None] * (queries.ndim - 2)), head, None)
    replicated = PartitionSpec()
    call = jax.shard_map(
        local, mesh=sharding.mesh, in_specs=(heads, pool, pool, replicated, *([replicated] * len(rows))),
        out_specs=heads, check_vma=False,
    )  # fmt: skip
    return call(queries, key_stack, value_stack, jnp.asarray(index, jnp.int32), *rows)


def flat_tables(tables: jax.Array, index, stack_shape: tuple[int, ...], layout: str) -> jax.Array:
    """Block tables ``[B, W]`` of layer ``index`` of a stack ``[L, P, ·, ·, D]`` as tables of the
    stack's flattened pages, ``[B, H_kv, W']`` for each K/V head h. 'heads' layout: the flattened
    pages are its ``[page_size, D]`` tiles, page j of row b is ``(index * P + tables[b, j]) * H_kv + h``
    (``W' = W``). 'tokens': one-token pages, slot t of row b is
    ``((index * P + tables[b, t // page_size]) * page_size + t % page_size) * H_kv + h`` (``W' = W * page_size``)."""
    layers, num_pages = stack_shape[:2]
    slot_axis, head_axis = slot_and_head_axes(layout)
    page_size, num_kv_heads = stack_shape[slot_axis], stack_shape[head_axis]
    if layers * num_pages * page_size * num_kv_heads > jnp.iinfo(jnp.int32).max:
        raise ValueError(f"paged_decode: a stack {stack_shape} has more token rows than an int32 block table indexes")
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :, None]
    pages = index * num_pages + tables  # [B, W]
    if layout == HEADS_LAYOUT:
        return pages[:, None, :] * num_kv_heads + heads
    slots = pages[:, :, None] * page_size + jnp.arange(page_size, dtype=jnp.int32)  # [B, W, page_size]
    return slots.reshape(tables.shape[0], 1, -1) * num_kv_heads + heads


def _in_place_decode(backend, queries, stacks, index, tables, lengths, quantization, layout, options) -> jax.Array:
    """The kernel over the stacks read in place: each (row, K/V head) a row of its own over one
    K/V head of the stacks' flattened pages (``flat_tables``). Returns ``[B, H_q, D]`` float32."""
    batch, num_heads, head_dim = queries.shape
    shape = (stacks[0].codes if quantization is not None else stacks[0]).shape
    num_kv_heads = shape[slot_and_head_axes(layout)[1]]
    (k_pages, k_scales), (v_pages, v_scales) = (_flat_pages(stack, quantization, layout) for stack in stacks)
    out = kernel_decode(
        backend, queries.reshape(batch * num_kv_heads, num_heads // num_kv_heads, head_dim), k_pages, v_pages,
        flat_tables(tables, index, shape, layout).reshape(batch * num_kv_heads, -1), jnp.repeat(lengths, num_kv_heads),
        k_scales=k_scales, v_scales=v_scales,
        pages_per_block=GPU_TOKENS_PER_BLOCK if layout == TOKENS_LAYOUT else GPU_PAGES_PER_BLOCK, **options,
    )  # fmt: skip
    return out.reshape(batch, num_heads, head_dim)


def _flat_pages(stack, quantization: QuantSpec | None, layout: str) -> tuple[jax.Array, jax.Array | None]:
    """A stack as one K/V head of pages ``[1, N, g, D]`` (g: 1 for 'tokens', ``page_size`` for
    'heads') and, quantized, their scales ``[1, N, g]`` float32 (fp8 codes as their float8 dtype):
    reshapes, no copy."""
    values = stack if quantization is None else jax.lax.bitcast_convert_type(stack.codes, quantization.number_dtype)
    size = 1 if layout == TOKENS_LAYOUT else values.shape[-2]
    pages = values.reshape(1, -1, size, values.shape[-1])
    return pages, None if quantization is None else stack.scales.reshape(1, -1, size).astype(jnp.float32)


def kernel_decode(
    backend: str, queries: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables: jax.Array, lengths: jax.Array,
    *, scale: float, logit_softcap: float | None = None, k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None, pages_per_block: int = GPU_PAGES_PER_BLOCK,
) -> jax.Array:  # fmt: skip
    """Decode attention by ``backend``'s kernel over pages in its own layout: ``queries``
    ``[B, H_q, D]`` (one token per row) over ``k_pages``/``v_pages`` ``[H_kv, P, page_size, D]``
    (float, or codes with ``k_scales``/``v_scales`` ``[H_kv, P, page_size]``: value = code * scale),
    row b reading slots ``0 .. lengths[b] - 1`` ``[B]`` through block table ``tables[b]`` ``[B, W]``
    (length 0: zeros). ``scale`` multiplies the logits, then ``logit_softcap`` caps them;
    ``pages_per_block``: the GPU kernel's pages per compute block. Returns ``[B, H_q, D]`` float32."""
    q = queries.astype(jnp.float32) * scale
    q = q if k_scales is not None else q.astype(k_pages.dtype)  # scaled codes are cast to the query's dtype
    lengths = lengths.astype(jnp.int32)
    if backend == PALLAS_GPU:
        out = _gpu_decode(q, k_pages, v_pages, tables, lengths, k_scales, v_scales, logit_softcap, pages_per_block)
    elif backend == PALLAS_TPU:
        out = _tpu_decode(q, k_pages, v_pages, tables, lengths, k_scales, v_scales, logit_softcap)
    else:
        raise ValueError(f"kernel_decode: backend must be {PALLAS_GPU!r} or {PALLAS_TPU!r}, got {backend!r}")
    return out.astype(jnp.float32)


def _kernel_pages(pool, quantization: QuantSpec | None) -> tuple[jax.Array, jax.Array | None]:
    """A layer's pool ``[P, page_size, H_kv, D]`` in the kernels' layout: pages ``[H_kv, P, page_size,
    D]`` and, quantized, the scale of each token ``[H_kv, P, page_size]`` float32 (fp8 codes as
    their float8 dtype)."""
    if quantization is None:
        return heads_major(pool), None
    codes = jax.lax.bitcast_convert_type(pool.codes, quantization.number_dtype)
    return heads_major(codes), heads_major(pool.scales)[..., 0].astype(jnp.float32)


def _padded(tables: jax.Array, multiple: int) -> jax.Array:
    """``tables`` ``[B, W]`` with padding columns up to a multiple of ``multiple``."""
    extra = -tables.shape[1] % multiple
    return jnp.pad(tables, ((0, 0), (0, extra)), constant_values=PADDING_PAGE)


def _gpu_decode(q, k_pages, v_pages, tables, lengths, k_scales, v_scales, logit_softcap, per_block) -> jax.Array:
    """The Pallas GPU kernel (split-K over ``GPU_K_SPLITS`` partitions of the table at most)."""
    per_block = min(per_block, tables.shape[1])
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
