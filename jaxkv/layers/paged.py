"""K/V in a pool of fixed-size pages shared by every row, read through a block table (vLLM's
paged attention, with static shapes).

The pool holds ``P`` pages of ``page_size`` slots. Row r's logical page j (positions
``j * page_size ...``) lives in pool page ``block_table[r, j]``. Page 0 is the null page:
block-table entries a row has not been given point at it, and padding tokens write into it,
so padding never touches a live page. Which pages a row owns, and when pages are shared
between rows (a common prefix) or freed (a finished row, a sliding window that moved on),
is decided outside ``jit`` by the host page manager (``jaxkv.serving.pages``); the layer
only writes and reads through the table it is given.

An update may pack the tokens of many rows into one sequence: ``token_rows`` ``[N]`` names
the block-table row of each of the update's ``B * T`` tokens (row-major), so a serving step
can run prefill chunks of some requests and single decode tokens of others as one
``[1, N]`` batch. Masks come from absolute positions only: slot s of logical page j holds
position ``j * page_size + s`` and is visible to a query at q if it is not in the future, is
inside the window, and its page is not the null page.

Pages may hold quantized K/V (a ``QuantSpec`` with per-token groups and no residual: int8,
int4 or fp8 codes with float16 group scales, quantized as they are written and dequantized
as attention gathers them), which cuts a page's bytes 2-4x at float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.protocol import CacheLayer, check_array, entry, limit_rollback, pytree_class
from jaxkv.quantization import PER_TOKEN, QuantizedTensor, QuantSpec, dequantize, empty_quantized, quantize
from jaxkv.sharding import BATCH, HEAD_DIM, KV_HEADS, PAGE_SLOTS, PAGES, TABLE, TOKENS, Axes

NULL_PAGE = 0
# Slots attention reads per loop iteration (a few pages at a time): fewer iterations than one
# page at a time, while the reads stay proportional to the filled length.
ATTENTION_BLOCK_SLOTS = 128
# Query tokens of one row that read their row's pages together (a prefill chunk's tokens come
# in blocks of this many; see ``PagedLayer.with_step``): gathering pages per token would
# read each page once per query token.
QUERY_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class Paging:
    """How ``Cache.from_config(paging=...)`` lays out paged layers.

    ``num_pages``: pages in the pool of full-attention layers (the null page included);
    ``sliding_num_pages``: the pool of sliding-window layers (default ``num_pages``): a
    sliding layer frees the pages that left its window, so it needs far fewer.
    ``max_length``: the longest sequence a row may reach (the block table's width in pages).
    ``num_tokens``: tokens one update packs (``B * T``; the serving step sets it per call).
    """

    page_size: int
    num_pages: int
    max_length: int
    sliding_num_pages: int | None = None
    num_tokens: int = 1

    def __post_init__(self):
        for name in ("page_size", "num_pages", "max_length", "num_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Paging.{name} must be positive, got {getattr(self, name)}")
        if self.num_pages < 2 or (self.sliding_num_pages is not None and self.sliding_num_pages < 2):
            raise ValueError("a page pool needs at least 2 pages (page 0 is the null page)")

    def pool_pages(self, window: int | None) -> int:
        """Pages of the pool a layer with this ``window`` (None: full attention) draws from."""
        return self.num_pages if window is None or self.sliding_num_pages is None else self.sliding_num_pages


def block_pages(page_size: int) -> int:
    """Pages attention reads per loop iteration (``ATTENTION_BLOCK_SLOTS`` slots, at least one page)."""
    return max(1, ATTENTION_BLOCK_SLOTS // page_size)


def table_width(max_length: int, page_size: int) -> int:
    """Block-table columns for rows of ``max_length`` tokens, a multiple of ``block_pages``."""
    pages = -(-max_length // page_size)
    step = block_pages(page_size)
    return -(-pages // step) * step


Pool = jax.Array | QuantizedTensor  # [L, P, page_size, H_kv, D], or its codes and scales


def check_page_quantization(spec: QuantSpec, head_dim: int) -> None:
    """Pages quantize each token on write: per-token groups, no full-precision residual."""
    if spec.axis_key != PER_TOKEN or spec.axis_value != PER_TOKEN or spec.residual_length:
        raise ValueError(
            "paged K/V are quantized token by token as they are written: use QuantSpec(axis_key=0, axis_value=0, "
            f"residual_length=0), got {spec}"
        )
    spec.check_head_dim(head_dim)


def empty_pool(shape: tuple[int, int, int, int], dtype, spec: QuantSpec | None) -> Pool:
    """Zero pages ``shape`` ``[P, page_size, H_kv, D]``: values, or codes and scales."""
    if spec is None:
        return jnp.zeros(shape, dtype)
    pages, size, heads, dim = shape
    return empty_quantized(pages, size, dim, heads, spec, PER_TOKEN)


def pool_shape(pool: Pool) -> tuple[int, ...]:
    """``[L, P, page_size, H_kv, ·]`` of a pool (its codes when quantized)."""
    return (pool.codes if isinstance(pool, QuantizedTensor) else pool).shape


@pytree_class
class PagedKVView:
    """What a paged update hands to attention (``jaxkv.attention.paged_attention``): the pools,
    the block table and each query token's row. Attention gathers each token's pages block
    by block, so a decode step reads each row's filled pages, never the whole pool."""

    key_stack: Pool  # [L, P, page_size, H_kv, D]
    value_stack: Pool
    index: jax.Array | int
    block_table: jax.Array  # [R, W]
    token_rows: jax.Array  # [N]
    window: int | None = struct.field(pytree_node=False, default=None)
    quantization: QuantSpec | None = struct.field(pytree_node=False, default=None)
    single_tokens: int | None = struct.field(pytree_node=False, default=None)  # see PagedLayer

    @property
    def page_size(self) -> int:
        return pool_shape(self.key_stack)[2]

    @property
    def block_pages(self) -> int:
        return block_pages(self.page_size)

    @property
    def num_kv_heads(self) -> int:
        return pool_shape(self.key_stack)[3]

    def gather(self, stack: Pool, pages: jax.Array) -> jax.Array:
        """Pages ``[N, K]`` of entry ``index``: values ``[N, K, page_size, H_kv, D]`` (dequantized).
        One gather from the stack: slicing the layer's pool out first would copy all of it."""
        found = jax.tree.map(lambda leaf: leaf[self.index, pages], stack)
        return found if self.quantization is None else dequantize(found, self.quantization, PER_TOKEN)

    def read_block(self, block, rows: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Page block ``block`` of each of ``rows`` ``[M]``: keys and values ``[M, S, H_kv, D]`` (S =
        ``block_pages * page_size`` slots) and the positions they hold ``[M, S]`` (-1 on the null page)."""
        width = self.block_pages
        columns = jax.lax.dynamic_slice_in_dim(self.block_table, block * width, width, axis=1)
        pages = columns[rows]  # [M, block_pages]
        keys, values = self.gather(self.key_stack, pages), self.gather(self.value_stack, pages)
        tokens, _, size, heads, dim = keys.shape
        slots = block * width * size + jnp.arange(width * size, dtype=jnp.int32)
        positions = jnp.where(jnp.repeat(pages, size, axis=1) != NULL_PAGE, slots[None, :], -1)
        shape = (tokens, width * size, heads, dim)
        return keys.reshape(shape), values.reshape(shape), positions

    def block_range(self, q_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The blocks any of the queries at ``q_positions`` ``[N]`` may see: ``[first, end)``.
        Up to the furthest query's page; a sliding window starts at the earliest query's window."""
        span = self.block_pages * self.page_size
        end = (jnp.max(q_positions) + span) // span  # 0 when every token is padding
        if self.window is None:
            return jnp.int32(0), end
        earliest = jnp.min(jnp.where(q_positions >= 0, q_positions, jnp.iinfo(jnp.int32).max))
        return jnp.minimum(jnp.maximum(earliest - self.window + 1, 0) // span, end), end


@pytree_class
class PagedLayer(CacheLayer):
    """Paged K/V: pages ``[P, page_size, H_kv, D]`` shared by all rows, read through a block table ``[B, W]``."""

    key_pages: Pool  # [P, page_size, H_kv, D] (codes and scales when quantized)
    value_pages: Pool
    block_table: jax.Array  # [R, W] int32: row r's logical page j is pool page block_table[r, j]
    token_rows: jax.Array  # [N] int32: the block-table row of each token of the next update
    lengths: jax.Array  # [R] int32
    window: int | None = struct.field(pytree_node=False, default=None)
    quantization: QuantSpec | None = struct.field(pytree_node=False, default=None)
    # The update's first ``single_tokens`` tokens read their rows' pages one by one; the rest
    # come in blocks of QUERY_BLOCK tokens of one row each. None: every token on its own.
    single_tokens: int | None = struct.field(pytree_node=False, default=None)

    MEMORY_FORMULA = (
        "2·P·page·H_kv·D·bytes + 4·B·(⌈S_max/page⌉ + 1) + 4·N; P pages (all rows share them), N packed tokens"
    )

    @classmethod
    def create(
        cls, num_rows: int, num_kv_heads: int, head_dim: int, paging: Paging, dtype=jnp.float32,
        window: int | None = None, quantization: QuantSpec | None = None,
    ) -> PagedLayer:  # fmt: skip
        """``quantization``: store the pages quantized (see ``check_page_quantization``)."""
        if quantization is not None:
            check_page_quantization(quantization, head_dim)
        pages = (paging.pool_pages(window), paging.page_size, num_kv_heads, head_dim)
        return cls(
            key_pages=empty_pool(pages, dtype, quantization),
            value_pages=empty_pool(pages, dtype, quantization),
            block_table=jnp.zeros((num_rows, table_width(paging.max_length, paging.page_size)), jnp.int32),
            token_rows=jnp.zeros((paging.num_tokens,), jnp.int32),
            lengths=jnp.zeros((num_rows,), jnp.int32),
            window=window,
            quantization=quantization,
        )

    @staticmethod
    def kv_bytes(batch_size, seq_len, num_kv_heads, head_dim, dtype, page_size: int = 16, **_) -> int:
        """Bytes of a pool holding exactly ``batch_size`` rows of ``seq_len`` tokens (plus the null page)."""
        pages = batch_size * -(-seq_len // page_size) + 1
        width = table_width(seq_len, page_size)
        page_bytes = 2 * page_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
        return pages * page_bytes + 4 * batch_size * (width + 1) + 4

    @property
    def page_size(self) -> int:
        return pool_shape(self.key_pages)[-3]

    @property
    def max_length(self) -> int:
        return self.block_table.shape[-1] * self.page_size

    @property
    def head_dim(self) -> int:
        if self.quantization is None:
            return self.key_pages.shape[-1]
        return self.key_pages.codes.shape[-1] * 8 // self.quantization.bits

    @property
    def max_rollback(self) -> None:
        return None

    def describe(self) -> str:
        quantized = f" {self.quantization.format}{self.quantization.bits}" if self.quantization else ""
        return f"page={self.page_size}" + (f" window={self.window}" if self.window else "") + quantized

    def logical_axes(self) -> PagedLayer:
        """Pages on ``pages`` (data parallel: each device keeps a share of the pool), K/V heads on
        ``kv_heads``; block-table rows and lengths on ``batch``."""
        lead = (PAGES, PAGE_SLOTS, KV_HEADS)

        def pool_axes(pool: Pool):
            return pool.logical_axes(*lead) if isinstance(pool, QuantizedTensor) else Axes(*lead, HEAD_DIM)

        return self.replace(
            key_pages=pool_axes(self.key_pages),
            value_pages=pool_axes(self.value_pages),
            block_table=Axes(BATCH, TABLE),
            token_rows=Axes(TOKENS),
            lengths=Axes(BATCH),
        )

    def with_step(
        self, block_table: jax.Array, token_rows: jax.Array, lengths: jax.Array, single_tokens: int | None = None
    ) -> PagedLayer:
        """This stacked layer with a step's ``block_table`` ``[R, W]``, ``token_rows`` ``[N]`` and
        ``lengths`` ``[R]`` (the same for every entry of the stack; ``N`` may change per step).

        ``single_tokens``: the first tokens read their rows' pages one by one (decodes of many
        rows); the other ``N - single_tokens`` must come in blocks of ``QUERY_BLOCK`` tokens of
        one row each (prefill chunks, padded to whole blocks), which attention reads once per
        block. None: every token on its own."""
        if single_tokens is not None and (token_rows.shape[0] - single_tokens) % QUERY_BLOCK:
            raise ValueError(
                f"PagedLayer.with_step: the {token_rows.shape[0] - single_tokens} tokens after single_tokens must "
                f"fill whole blocks of {QUERY_BLOCK}"
            )
        depth = self.lengths.shape[0]
        return self.replace(
            single_tokens=single_tokens,
            block_table=jnp.broadcast_to(block_table, (depth, *block_table.shape)),
            token_rows=jnp.broadcast_to(token_rows, (depth, *token_rows.shape)),
            lengths=jnp.broadcast_to(lengths, (depth, *lengths.shape)),
        )

    def update_entry(self, index, keys, values, positions) -> tuple[PagedLayer, PagedKVView]:
        """Write ``[B, H_kv, T, D]`` at ``positions`` ``[B, T]`` through the block table; token
        ``b * T + t`` belongs to row ``token_rows[b * T + t]``.

        Padding (a negative position) and positions past the table's width land on the null
        page. Under ``jit`` nothing checks that a row owns the page a position maps to: the
        host page manager gives rows their pages before the step."""
        tokens, page, offset, rows = self.slots(index, keys, values, positions)

        def write(pool: Pool, new: jax.Array) -> Pool:
            stored = new if self.quantization is None else quantize(new, self.quantization, PER_TOKEN)
            return jax.tree.map(lambda leaf, x: leaf.at[index, page, offset].set(x), pool, stored)

        new = self.replace(
            key_pages=write(self.key_pages, self.flat(keys)),
            value_pages=write(self.value_pages, self.flat(values)),
            lengths=self.lengths.at[index].set(entry(self.lengths, index).at[rows].max(jnp.maximum(tokens + 1, 0))),
        )
        table = entry(self.block_table, index)
        view = PagedKVView(
            new.key_pages, new.value_pages, index, table, rows, self.window, self.quantization, self.single_tokens
        )
        return new, view

    @staticmethod
    def flat(x: jax.Array) -> jax.Array:
        """``[B, H, T, D]`` -> ``[B * T, H, D]``, tokens row-major."""
        batch, heads, length, dim = x.shape
        return x.transpose(0, 2, 1, 3).reshape(batch * length, heads, dim)

    def slots(self, index, keys, values, positions) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Checked inputs as flat token positions ``[N]``, the page and offset each is written to,
        and each token's row."""
        caller = f"{type(self).__name__}.update"
        _, _, _, heads, _ = pool_shape(self.key_pages)
        dim = self.head_dim
        dtype = keys.dtype if self.quantization else self.key_pages.dtype  # quantized: any float dtype
        for what, x in (("keys", keys), ("values", values)):
            check_array(caller, what, x, ("B", "H_kv", "T", "D"), (keys.shape[0], heads, None, dim), dtype)
        positions = jnp.asarray(positions, jnp.int32)
        rows = entry(self.token_rows, index)
        if keys.shape != values.shape or positions.shape != keys.shape[:1] + keys.shape[2:3]:
            raise ValueError(
                f"{caller}: keys {keys.shape}, values {values.shape}, positions {positions.shape} disagree"
            )
        if positions.size != rows.shape[0]:
            raise ValueError(
                f"{caller}: {positions.size} tokens but token_rows names the rows of {rows.shape[0]}; give the "
                f"step's rows with PagedLayer.with_step"
            )
        tokens = positions.reshape(-1)
        table = entry(self.block_table, index)
        logical = tokens // self.page_size
        stored = (tokens >= 0) & (logical < table.shape[1])
        page = jnp.where(stored, table[rows, jnp.clip(logical, 0, table.shape[1] - 1)], NULL_PAGE)
        return jnp.where(stored, tokens, -1), page, jnp.where(stored, tokens % self.page_size, 0), rows

    def rollback(self, num_tokens) -> PagedLayer:
        """Forget each row's last tokens (their slots become invisible; the pages stay the row's)."""
        return self.replace(lengths=self.lengths - limit_rollback(self, num_tokens, self.lengths))

    def reset(self) -> PagedLayer:
        """Every row empty and pointing at the null page; the pool's contents are left (masked)."""
        return self.replace(block_table=jnp.zeros_like(self.block_table), lengths=jnp.zeros_like(self.lengths))

    def gather_rows(self, indices: jax.Array) -> PagedLayer:
        """Rows ``indices`` of the block table and lengths; the pool is shared, not copied. Rows that
        now share a page must not both write it: the host manager forks with copy-on-write."""
        indices = jnp.asarray(indices, jnp.int32)
        return self.replace(
            block_table=jnp.take(self.block_table, indices, axis=0), lengths=jnp.take(self.lengths, indices, axis=0)
        )
