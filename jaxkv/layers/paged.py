"""K/V in a pool of fixed-size pages shared by every row, read through a block table (vLLM's
paged attention, with static shapes).

The pool holds ``P`` pages of ``page_size`` slots. Row r's logical page j (positions
``j * page_size ...``) lives in pool page ``block_table[r, j]``. Page 0 is the null page:
block-table entries a row has not been given point at it, and padding tokens write into it,
so padding never touches a live page. Which pages a row owns, and when pages are shared
between rows (a common prefix) or freed (a finished row, a sliding window that moved on),
is decided outside ``jit`` by the host page manager (``jaxkv.serving.pages``); the layer
only writes and reads through the table it is given.

The layer holds the pages and nothing per row or per step: each update is a serving step's
packed batch (``jaxkv.batch.PackedBatch``, an argument beside the cache) that names each
token's row and carries the block tables, so a step can run prefill chunks of some requests
and the decode tokens of others as one ``[1, N]`` batch. Masks come from absolute
positions only: slot s of logical page j holds position ``j * page_size + s`` and is visible
to a query at q if it is not in the future, is inside the window, and its page is not the
null page. A row whose pages were compacted (``jaxkv.serving.compaction``: an engine with
``max_pages_per_request``) holds non-contiguous positions, chosen per layer and K/V head: the
packed batch then carries each row's ``shift`` (a token at position p is written to the row's
slot ``p - shift``), the pool keeps the position each slot holds per K/V head
(``PagedLayer.slot_positions``, -1 where a compaction left it empty), and a query at slot q sees
its row's slots up to q that hold a token (keys keep the positions RoPE gave them when they were
written).

With ``Paging.retrieval`` (Quest in the engine) the full-attention pool also keeps a summary of
each page's keys (``PagedLayer.page_summaries``), and each decode token (and, under
``prefill='retrieve'``, each prefill query) reads a budget of its row's pages chosen by them
(``jaxkv.layers.retrieval``'s choice: sink pages, recent pages, the best scored in between) instead
of all of them.

Pages may hold quantized K/V (a ``QuantSpec`` with per-token groups and no residual: int8,
int4 or fp8 codes with float16 group scales, quantized as they are written and dequantized
as attention gathers them), which cuts a page's bytes 2-4x at float32.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.batch import QUERY_BLOCK, PackedAttention, PackedBatch, PagedStorage
from jaxkv.kernels import (
    AUTO,
    CPU,
    TOKENS_LAYOUT,
    XLA,
    check_backend,
    check_layout,
    kernel_route,
    paged_blocks,
    paged_decode,
    prefill_route,
    slot_and_head_axes,
    split_pool,
)
from jaxkv.page_table import FULL_POOL, NULL_PAGE, SLIDING_POOL, block_pages, page_slots
from jaxkv.protocol import CacheLayer, MaskInfo, Rollback, RowSelection, check_array, pytree_class
from jaxkv.quantization import PER_TOKEN, QuantizedTensor, QuantSpec, dequantize, empty_quantized, quantize
from jaxkv.retrieval import RetrievalSpec, attended_pages, page_scores, page_summary
from jaxkv.sharding import HEAD_DIM, KV_HEADS, PAGE_SLOTS, PAGES, Axes, Layout
from jaxkv.softmax import attention_mask, softmax_init, softmax_step


def pool_name(window: int | None) -> str:
    """The pool (and block table) a paged layer reads: 'sliding' for a window, else 'full'."""
    return FULL_POOL if window is None else SLIDING_POOL


@dataclasses.dataclass(frozen=True)
class Paging:
    """How ``Cache.from_config(paging=...)`` lays out paged layers.

    ``num_pages``: pages in the pool of full-attention layers (the null page included);
    ``sliding_num_pages``: the pool of sliding-window layers (default ``num_pages``): a
    sliding layer frees the pages that left its window, so it needs far fewer.
    ``max_length``: the longest sequence a row may reach (the engine's ``max_model_len``).
    ``scored``: full-attention layers also keep the attention mass each slot received
    (``PagedLayer.slot_scores``), for a compaction policy that ranks tokens by it.
    ``compacted``: full-attention rows may be compacted (``max_pages_per_request``): their layers
    keep the position each slot holds per K/V head (``PagedLayer.slot_positions``).
    ``attention_backend``: what reads the decode tokens (``jaxkv.kernels``: 'xla', 'pallas_gpu',
    'pallas_tpu', 'cpu', which reads prefill chunks too; resolve 'auto' first with
    ``jaxkv.kernels.resolve_backend``).
    ``layout``: how a layer's pages are stored: 'tokens' ``[P, page_size, H_kv, D]`` or 'heads'
    ``[P, H_kv, page_size, D]`` (each head's slots of a page together: the kernels read such a
    pool in place, page by page; XLA reads either).
    ``sharding``: the mesh and rules the pools are sharded by (``Cache.from_config(mesh=...)`` sets
    it): a kernel call is split over them by hand (``jaxkv.kernels.paged_decode``).
    ``retrieval``: full-attention layers summarize each page's keys and their queries read a budget
    of pages chosen by those summaries (``RetrievalSpec`` with ``page_size`` this ``page_size`` and
    sequential pages; under ``prefill='dense'`` a prefill chunk reads every page, decode tokens
    retrieve).
    """

    page_size: int
    num_pages: int
    max_length: int
    sliding_num_pages: int | None = None
    scored: bool = False
    compacted: bool = False
    attention_backend: str = XLA
    layout: str = TOKENS_LAYOUT
    sharding: Layout | None = None
    retrieval: RetrievalSpec | None = None

    def __post_init__(self):
        check_layout(self.layout, "Paging.layout")
        self._check_retrieval()
        if check_backend(self.attention_backend, "Paging.attention_backend") == AUTO:
            raise ValueError("Paging.attention_backend: resolve 'auto' first (jaxkv.kernels.resolve_backend)")
        for name in ("page_size", "num_pages", "max_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Paging.{name} must be positive, got {getattr(self, name)}")
        if self.num_pages < 2 or (self.sliding_num_pages is not None and self.sliding_num_pages < 2):
            raise ValueError("a page pool needs at least 2 pages (page 0 is the null page)")

    def _check_retrieval(self) -> None:
        spec = self.retrieval
        if spec is None:
            return
        if spec.page_size != self.page_size:
            raise ValueError(
                f"Paging.retrieval: its pages are the pool's, so its page_size must be {self.page_size}, got "
                f"{spec.page_size}"
            )
        if spec.pages != "sequential" or spec.dense_layers:
            raise ValueError(
                "Paging.retrieval: a page pool holds its pages in position order and every layer retrieves: use "
                f"pages='sequential' and dense_layers=0, got pages={spec.pages!r}, dense_layers={spec.dense_layers}"
            )
        if self.scored or self.compacted:
            raise ValueError("Paging.retrieval keeps every token: it does not combine with compacted rows")

    def pool_pages(self, window: int | None) -> int:
        """Pages of the pool a layer with this ``window`` (None: full attention) draws from."""
        return self.num_pages if window is None or self.sliding_num_pages is None else self.sliding_num_pages


def table_width(max_length: int, page_size: int) -> int:
    """Block-table columns for rows of ``max_length`` tokens, a multiple of ``block_pages``."""
    pages = -(-max_length // page_size)
    step = block_pages(page_size)
    return -(-pages // step) * step


PageArray = jax.Array | QuantizedTensor  # [L, P, page_size, H_kv, D], or its codes and scales


def check_page_quantization(spec: QuantSpec, head_dim: int) -> None:
    """Pages quantize each token on write: per-token groups, no full-precision residual."""
    if spec.axis_key != PER_TOKEN or spec.axis_value != PER_TOKEN or spec.residual_length:
        raise ValueError(
            "paged K/V are quantized token by token as they are written: use QuantSpec(axis_key=0, axis_value=0, "
            f"residual_length=0), got {spec}"
        )
    spec.check_head_dim(head_dim)


def empty_pool(shape: tuple[int, ...], dtype, spec: QuantSpec | None, layout: str = TOKENS_LAYOUT) -> PageArray:
    """Zero pages ``shape`` ``[P, page_size, H_kv, D]`` stored in ``layout`` (see ``Paging``):
    values, or codes and scales."""
    pages, size, heads, dim = shape
    inner = (size, heads) if layout == TOKENS_LAYOUT else (heads, size)
    if spec is None:
        return jnp.zeros((pages, *inner, dim), dtype)
    return empty_quantized(pages, inner[0], dim, inner[1], spec, PER_TOKEN)


def _slot(layout: str, page: jax.Array, offset: jax.Array) -> tuple:
    """The index of slots (``page``, ``offset``) in a pool of ``layout`` after its leading axes:
    their K/V heads come first in the result either way (NumPy's advanced indexing)."""
    return (page, offset) if layout == TOKENS_LAYOUT else (page, slice(None), offset)


def _head_slot(layout: str, layer, page, offset, head) -> tuple:
    """The index of K/V head ``head``'s slot (``page``, ``offset``) of entry ``layer`` (index arrays
    of one broadcast shape ``[...]``) in a stacked pool of ``layout``: ``[..., ·]`` either way."""
    return (layer, page, offset, head) if layout == TOKENS_LAYOUT else (layer, page, head, offset)


def _read(stack: PageArray, at: tuple, quantization: QuantSpec | None) -> jax.Array:
    """``stack[at]``, dequantized: one gather from the stacked pool (slicing a layer's pool out
    first would copy all of it)."""
    found = jax.tree.map(lambda leaf: leaf[at], stack)
    return found if quantization is None else dequantize(found, quantization, PER_TOKEN)


def _entry_pages(stack: PageArray, index, pages: jax.Array, quantization: QuantSpec | None, layout: str) -> jax.Array:
    """Pages ``pages`` (any shape ``[...]``) of entry ``index`` of a stacked pool: ``[..., page_size,
    H_kv, D]`` (dequantized)."""
    return _tokens_major(_read(stack, (index, pages), quantization), layout)


def _dense_or_retrieved(dense_tokens: jax.Array, positions: jax.Array, dense: Callable, retrieved: Callable):
    """``[M, H_kv, G, D]``: ``dense()``'s output for the tokens flagged in ``dense_tokens`` ``[M]``,
    ``retrieved()``'s for the others; a part whose real tokens (``positions`` ``[M]`` >= 0) all
    take one of them computes that one alone (a prompt's chunks read densely, decodes retrieve)."""
    padding = positions < 0
    branch = jnp.where(jnp.all(dense_tokens | padding), 0, jnp.where(jnp.all(~dense_tokens | padding), 1, 2))
    mixed = lambda: jnp.where(dense_tokens[:, None, None, None], dense(), retrieved())
    return jax.lax.switch(branch, [dense, retrieved, mixed])


def _tokens_major(pages: jax.Array, layout: str) -> jax.Array:
    """Gathered pages ``[..., page_size, H_kv, D]`` from pages stored in ``layout``."""
    return pages if layout == TOKENS_LAYOUT else pages.swapaxes(-3, -2)


def pool_shape(pool: PageArray) -> tuple[int, ...]:
    """``[L, P, page_size, H_kv, ·]`` of a pool (its codes when quantized)."""
    return (pool.codes if isinstance(pool, QuantizedTensor) else pool).shape


@pytree_class
class PagedKVView:
    """What a paged update hands to attention: the pools, the step's block table and each query
    token's row. ``attend`` gathers each token's pages block by block, so a decode step reads
    each row's filled pages, never the whole pool."""

    key_stack: PageArray  # [L, P, page_size, H_kv, D]
    value_stack: PageArray
    index: jax.Array | int
    block_table: jax.Array  # [R, W]
    token_rows: jax.Array  # [N]
    decode_tokens: int = struct.field(pytree_node=False)  # see PackedBatch
    decode_width: int = struct.field(pytree_node=False, default=1)
    window: int | None = struct.field(pytree_node=False, default=None)
    quantization: QuantSpec | None = struct.field(pytree_node=False, default=None)
    shifts: jax.Array | None = None  # [R]: see PackedBatch (None: slot = position)
    slot_positions: jax.Array | None = None  # [L, P, page_size, H_kv]: see PagedLayer.slot_positions
    backend: str = struct.field(pytree_node=False, default=XLA)  # reads the decode tokens (jaxkv.kernels)
    layout: str = struct.field(pytree_node=False, default=TOKENS_LAYOUT)  # see Paging
    sharding: Layout | None = struct.field(pytree_node=False, default=None)  # see Paging
    decode_pages: int | None = struct.field(pytree_node=False, default=None)  # see PackedBatch
    summaries: jax.Array | None = None  # [L, P, C, H_kv, D]: see PagedLayer.page_summaries
    retrieval: RetrievalSpec | None = struct.field(pytree_node=False, default=None)  # see Paging
    dense_queries: jax.Array | None = None  # [N]: see PackedBatch

    @property
    def page_size(self) -> int:
        return pool_shape(self.key_stack)[slot_and_head_axes(self.layout)[0]]

    @property
    def block_pages(self) -> int:
        return block_pages(self.page_size)

    @property
    def num_kv_heads(self) -> int:
        return pool_shape(self.key_stack)[slot_and_head_axes(self.layout)[1]]

    @property
    def decode_columns(self) -> int:
        """Block-table columns a decode block reads and scores: those holding ``decode_pages``
        pages (all of them when None)."""
        columns = self.block_table.shape[1]
        if self.decode_pages is None:
            return columns
        return min(columns, table_width(self.decode_pages * self.page_size, self.page_size))

    def gather(self, stack: PageArray, pages: jax.Array) -> jax.Array:
        """Pages ``[N, K]`` of entry ``index``: values ``[N, K, page_size, H_kv, D]`` (dequantized)."""
        return _entry_pages(stack, self.index, pages, self.quantization, self.layout)

    def read_block(self, block, rows: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
        """Page block ``block`` of each of ``rows`` ``[M]``: keys and values ``[M, S, H_kv, D]`` (S =
        ``block_pages * page_size`` slots), the row's slot each is ``[M, S]`` (-1 on the null page)
        and, in a compacted pool, whether it holds a token for each K/V head ``[M, S, H_kv]`` (None
        otherwise: every slot up to a query's own does)."""
        width = self.block_pages
        columns = jax.lax.dynamic_slice_in_dim(self.block_table, block * width, width, axis=1)
        pages = columns[rows]  # [M, block_pages]
        keys, values = self.gather(self.key_stack, pages), self.gather(self.value_stack, pages)
        tokens, _, size, heads, dim = keys.shape
        slots = block * width * size + jnp.arange(width * size, dtype=jnp.int32)
        slots = jnp.where(jnp.repeat(pages, size, axis=1) != NULL_PAGE, slots[None, :], -1)
        held = None
        if self.slot_positions is not None:
            held = self.slot_positions[self.index, pages].reshape(tokens, width * size, heads) >= 0
        shape = (tokens, width * size, heads, dim)
        return keys.reshape(shape), values.reshape(shape), slots, held

    def query_slots(self, q_positions: jax.Array, rows: jax.Array) -> jax.Array:
        """The slots ``[b, Q]`` queries at ``q_positions`` ``[b, Q]`` of block rows ``rows`` ``[b]``
        are written to (their positions unless the rows are shifted; -1 for padding)."""
        if self.shifts is None:
            return q_positions
        return jnp.where(q_positions >= 0, q_positions - self.shifts[rows][:, None], -1)

    def block_range(self, q_positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The blocks any of the queries at ``q_positions`` ``[N]`` (their slots when shifted) may see:
        ``[first, end)``. Up to the furthest query's page; a sliding window starts at the earliest
        query's window."""
        span = self.block_pages * self.page_size
        end = (jnp.max(q_positions) + span) // span  # 0 when every token is padding
        if self.window is None:
            return jnp.int32(0), end
        earliest = jnp.min(jnp.where(q_positions >= 0, q_positions, jnp.iinfo(jnp.int32).max))
        return jnp.minimum(jnp.maximum(earliest - self.window + 1, 0) // span, end), end

    def attend(self, queries, q_positions, *, scale: float, logit_softcap=None, block_size=None, query_weights=None):
        """Attention of the packed queries ``[B, H_q, T, D]`` at ``q_positions`` ``[B, T]`` over their
        rows' pages. Returns ``[B, H_q, T, D]``; with ``query_weights`` ``[B, T]``, also the slot
        mass, one ``[Z, C * page_size, H_kv]`` per part of ``query_block_rows`` (the decode blocks
        over ``decode_columns``, the prefill blocks over all ``W`` columns): for each query block
        the attention probability each slot of its row's first ``C`` table columns received,
        summed over the query heads of its K/V head and over the block's queries, query t weighted
        by ``query_weights``.

        The ``B * T`` query tokens (row-major) come from many rows. The first ``decode_tokens``
        come in blocks of ``decode_width`` tokens of one row (single decodes, or a row's token and
        its drafts), each block reading its row's pages (``token_rows``); the rest come in blocks of
        ``QUERY_BLOCK`` tokens of one row each (a prefill chunk), which read their row's pages
        once per block instead of once per token (``_read_blocks``). The backend's kernel reads
        the blocks ``kernel_route`` (decode) and ``prefill_route`` (prefill) give it. A retrieving
        pool's queries read their chosen pages instead (``_retrieved``), or every page where
        ``dense_queries`` says so. ``block_size`` is the plain views' option: pages are read
        ``block_pages`` at a time."""
        batch, num_heads, length, head_dim = queries.shape
        tokens, num_kv_heads = batch * length, self.num_kv_heads
        grouped = queries.transpose(0, 2, 1, 3).reshape(tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
        positions = q_positions.reshape(tokens)
        weights = None if query_weights is None else query_weights.reshape(tokens).astype(jnp.float32)
        single = self.decode_tokens

        def read(start, end, query_block, columns):
            rows = self.token_rows[start:end:query_block]
            block_weights = None if weights is None else weights[start:end]
            return self._read_blocks(
                grouped[start:end], positions[start:end], rows, query_block, columns, scale, logit_softcap,
                block_weights,
            )  # fmt: skip

        def retrieve(start, end, query_block, columns):  # a retrieving pool's read (``_retrieved``)
            rows = self.token_rows[start:end:query_block]
            retrieved = functools.partial(
                self._retrieved, grouped[start:end], positions[start:end], rows, query_block, scale, logit_softcap
            )
            if self.dense_queries is None:
                return retrieved()
            dense = functools.partial(read, start, end, query_block, columns)
            return _dense_or_retrieved(self.dense_queries[start:end], positions[start:end], dense, retrieved)

        if self.retrieval is not None and weights is not None:
            raise ValueError("a retrieving pool reads a budget of pages per query and reports no slot mass")
        part = read if self.retrieval is None else retrieve
        if single and self.retrieval is None and self.kernel_route(head_dim, slot_mass=weights is not None) is None:
            parts = [self._kernel_decode(grouped[:single], positions[:single], scale, logit_softcap)]
        else:
            parts = [part(0, single, self.decode_width, self.decode_columns)] if single else []
        if single < tokens and self.retrieval is None and self.prefill_route(slot_mass=weights is not None) is None:
            rows = self.token_rows[single::QUERY_BLOCK]
            parts.append(self._cpu_blocks(grouped[single:], positions[single:], rows, scale, logit_softcap))
        elif single < tokens:
            parts.append(part(single, tokens, QUERY_BLOCK, self.block_table.shape[1]))
        outs = [part if weights is None else part[0] for part in parts]
        out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]  # [N, H_kv, G, D]
        out = out.reshape(batch, length, num_heads, head_dim).transpose(0, 2, 1, 3).astype(queries.dtype)
        if weights is None:
            return out
        return out, tuple(part[1] for part in parts)

    def _retrieved(self, grouped, positions, rows, query_block: int, scale: float, logit_softcap) -> jax.Array:
        """Blocks of ``query_block`` queries ``grouped`` ``[M, H_kv, G, D]`` at ``positions`` ``[M]``,
        block b of row ``rows[b]``, each query and K/V head reading the pages of its row that
        ``attended_pages`` chooses by the page summaries (``[M, H_kv, G, D]`` float32): a gather of
        ``budget`` tokens per query and head, never the row's other pages."""
        tokens, num_kv_heads, group, head_dim = grouped.shape
        q = grouped.reshape(tokens // query_block, query_block, num_kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
        q_positions = positions.reshape(-1, query_block)  # [b, Q]
        table = self.block_table[rows]  # [b, W]
        columns = self._chosen_columns(q, q_positions, table)  # [b, H_kv, Q, A]
        pages = jnp.where(columns >= 0, table[jnp.arange(table.shape[0])[:, None, None, None], columns], NULL_PAGE)
        keys, values = self._gathered(self.key_stack, pages), self._gathered(self.value_stack, pages)
        slots = columns[..., None] * self.page_size + jnp.arange(self.page_size, dtype=jnp.int32)
        held = jnp.where((pages != NULL_PAGE)[..., None], slots, -1).reshape(*pages.shape[:3], -1)  # [b, H_kv, Q, S]
        visible = (held >= 0) & (held <= q_positions[:, None, :, None]) & (q_positions[:, None, :, None] >= 0)
        logits = jnp.einsum("bhgqd,bhqsd->bhgqs", q, keys, preferred_element_type=jnp.float32) * scale
        if logit_softcap is not None:
            logits = logit_softcap * jnp.tanh(logits / logit_softcap)
        logits = jnp.where(visible[:, :, None], logits, -jnp.inf)
        values = jnp.where(visible[..., None], values, 0)  # a freed page may hold NaN

        def weigh(weights):
            weights = weights.astype(values.dtype)
            return jnp.einsum("bhgqs,bhqsd->bhgqd", weights, values, preferred_element_type=jnp.float32)

        _, total, out = softmax_step(softmax_init(q.shape[:-1], head_dim), logits, weigh)
        total = jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
        return (out / total).transpose(0, 3, 1, 2, 4).reshape(grouped.shape)

    def _chosen_columns(self, q: jax.Array, q_positions: jax.Array, table: jax.Array) -> jax.Array:
        """The block-table columns ``[b, H_kv, Q, A]`` (-1: none) queries ``q`` ``[b, H_kv, G, Q, D]`` at
        ``q_positions`` ``[b, Q]`` read, scored by the summaries of their rows' pages ``table`` ``[b, W]``."""
        summaries = self.summaries[self.index, table].transpose(0, 3, 1, 2, 4)  # [b, H_kv, W, C, D]
        return attended_pages(self.retrieval, page_scores(self.retrieval.summary, q, summaries), q_positions)

    def _gathered(self, stack: PageArray, pages: jax.Array) -> jax.Array:
        """Per K/V head h, the slots of ``pages[:, h]`` (``[b, H_kv, Q, A]``) of entry ``index``:
        ``[b, H_kv, Q, A * page_size, D]`` (dequantized)."""
        heads = jnp.arange(pages.shape[1])[None, :, None, None]
        at = (self.index, pages, slice(None), heads) if self.layout == TOKENS_LAYOUT else (self.index, pages, heads)
        values = _read(stack, at, self.quantization)  # [b, H_kv, Q, A, page_size, D]
        return values.reshape(*pages.shape[:3], -1, values.shape[-1])

    def kernel_route(self, head_dim: int, slot_mass: bool) -> str | None:
        """Why the decode tokens are read by XLA (``jaxkv.kernels.kernel_route``); None: by the
        backend's kernel."""
        return kernel_route(
            self.backend, window=self.window, decode_width=self.decode_width,
            shifted=self.shifts is not None or self.slot_positions is not None, slot_mass=slot_mass,
            quantization=self.quantization, head_dim=head_dim,
            split_pool=split_pool(self.sharding, pool_shape(self.key_stack), self.layout),
        )  # fmt: skip

    def prefill_route(self, slot_mass: bool) -> str | None:
        """Why the prefill chunks are read by XLA (``jaxkv.kernels.prefill_route``); None: by the CPU kernel."""
        return prefill_route(
            self.backend, shifted=self.shifts is not None or self.slot_positions is not None, slot_mass=slot_mass,
            split_pool=split_pool(self.sharding, pool_shape(self.key_stack), self.layout),
        )  # fmt: skip

    def _kernel_decode(self, grouped: jax.Array, positions: jax.Array, scale: float, logit_softcap) -> jax.Array:
        """Decode tokens ``grouped`` ``[M, H_kv, G, D]`` at ``positions`` ``[M]`` (-1: padding) by the
        backend's kernel over slots ``0 .. position`` of their rows: ``[M, H_kv, G, D]``. The CPU
        kernel takes them in blocks of ``decode_width`` tokens of one row (a token and its drafts)."""
        tokens, num_kv_heads, group, head_dim = grouped.shape
        if self.backend == CPU:
            rows = self.token_rows[:tokens : self.decode_width]
            return self._cpu_blocks(grouped, positions, rows, scale, logit_softcap)
        out = paged_decode(
            self.backend, grouped.reshape(tokens, num_kv_heads * group, head_dim), self.key_stack, self.value_stack,
            self.index, self.block_table[self.token_rows[:tokens]], jnp.maximum(positions + 1, 0), scale=scale,
            logit_softcap=logit_softcap, quantization=self.quantization, layout=self.layout, sharding=self.sharding,
        )  # fmt: skip
        return out.reshape(grouped.shape)

    def _cpu_blocks(self, grouped: jax.Array, positions: jax.Array, rows: jax.Array, scale: float, logit_softcap):
        """Blocks of query tokens ``grouped`` ``[M, H_kv, G, D]`` at ``positions`` ``[M]`` (-1: padding),
        block b of row ``rows[b]`` ``[Z]`` (``M / Z`` tokens each), by the CPU kernel over their rows'
        pages (within the window): ``[M, H_kv, G, D]`` float32."""
        tokens, num_kv_heads, group, head_dim = grouped.shape
        blocks = rows.shape[0]
        out = paged_blocks(
            grouped.reshape(blocks, tokens // blocks, num_kv_heads * group, head_dim), positions.reshape(blocks, -1),
            self.key_stack, self.value_stack, self.index, self.block_table[rows], scale=scale,
            logit_softcap=logit_softcap, window=self.window, quantization=self.quantization, layout=self.layout,
            sharding=self.sharding,
        )  # fmt: skip
        return out.reshape(grouped.shape)

    def query_block_rows(self, num_tokens: int) -> tuple[jax.Array, ...]:
        """The row of each query block of ``num_tokens`` packed tokens, in ``attend``'s order and
        parts: ``[Z_decode]`` (if any decode) then ``[Z_prefill]`` (if any prefill)."""
        single = self.decode_tokens
        decodes = [self.token_rows[:single : self.decode_width]] if single else []
        prefills = [self.token_rows[single:num_tokens:QUERY_BLOCK]] if single < num_tokens else []
        return tuple(decodes + prefills)

    def _block_logits(self, block, q, q_slots, rows, scale, logit_softcap):
        """Page block ``block`` of ``rows`` ``[b]`` for query blocks ``q`` ``[b, Q, H_kv, G, D]`` written
        to slots ``q_slots`` ``[b, Q]`` (``query_slots``): masked logits ``[b, H_kv, G, Q, S]`` (-inf
        where masked), the values ``[b, S, H_kv, D]`` (zeroed where no query may see them: a freed
        page may hold anything, NaN included, and a zero weight times NaN is still NaN). Slots hold
        positions in order, so masking by slot is masking by position."""
        keys, values, slots, held = self.read_block(block, rows)  # [b, S, H_kv, D], [b, S], [b, S, H_kv]
        mask = attention_mask(q_slots, MaskInfo(slots, window=self.window))  # [b, Q, S]
        visible, seen = mask[:, None, None], jnp.any(mask, axis=1)[:, :, None]  # [b, 1, 1, Q, S], [b, S, 1]
        if held is not None:  # a compaction's empty slots, per K/V head
            visible, seen = visible & held.transpose(0, 2, 1)[:, :, None, None], seen & held
        logits = jnp.einsum("bqhgd,bshd->bhgqs", q, keys, preferred_element_type=jnp.float32) * scale
        if logit_softcap is not None:
            logits = logit_softcap * jnp.tanh(logits / logit_softcap)
        logits = jnp.where(visible, logits, -jnp.inf)
        return logits, jnp.where(seen[..., None], values, 0)

    def _read_blocks(
        self, grouped: jax.Array, positions: jax.Array, rows: jax.Array, query_block: int, columns: int,
        scale: float, logit_softcap: float | None, weights: jax.Array | None = None,
    ):  # fmt: skip
        """Blocks of ``query_block`` query tokens ``grouped`` ``[M, H_kv, G, D]`` at ``positions``
        ``[M]``, block b of row ``rows[b]``, over their rows' pages page block by page block with an
        online softmax, from the first page block a window reaches to the last filled one, within
        the table's first ``columns`` (a multiple of ``block_pages``; the caller's promise that
        the rows' queries see nothing past them). Returns ``[M, H_kv, G, D]`` float32; with query
        ``weights`` ``[M]``, also the slot mass ``[M / query_block, columns * page_size, H_kv]``:
        each slot's probability from the softmax's max and total, weighted and summed. Decode
        blocks (fewer than ``QUERY_BLOCK`` queries) keep their logits as they go
        (``[b, H_kv, G, Q, columns * page_size]``: ``G`` times the mass's bytes)
        and weigh them once after, instead of gathering and multiplying the pages again; prefill
        blocks would keep ``QUERY_BLOCK`` times that, so they recompute them in a second pass over
        the same page blocks. The mask is ``attention_mask``'s, per query: rows never see each
        other's slots."""
        tokens, num_kv_heads, group, head_dim = grouped.shape
        num_blocks = tokens // query_block
        q = grouped.reshape(num_blocks, query_block, num_kv_heads, group, head_dim)
        q_slots = self.query_slots(positions.reshape(num_blocks, query_block), rows)  # [b, Q]
        span, width = self.block_pages * self.page_size, columns * self.page_size
        keep = weights is not None and query_block < QUERY_BLOCK

        def fold(block, state):
            logits, values = self._block_logits(block, q, q_slots, rows, scale, logit_softcap)

            def weigh(weights):
                weights = weights.astype(values.dtype)
                return jnp.einsum("bhgqs,bshd->bhgqd", weights, values, preferred_element_type=jnp.float32)

            return logits, softmax_step(state, logits, weigh)

        def kept_step(block, carry):
            logits, state = fold(block, carry[0])
            return state, jax.lax.dynamic_update_slice_in_dim(carry[1], logits, block * span, axis=4)

        first, end = self.block_range(q_slots.reshape(-1))
        end = jnp.minimum(end, columns // self.block_pages)
        init = softmax_init((num_blocks, num_kv_heads, group, query_block), head_dim)
        if keep:
            blank = jnp.full((num_blocks, num_kv_heads, group, query_block, width), -jnp.inf, jnp.float32)
            (peak, total, out), kept = jax.lax.fori_loop(first, end, kept_step, (init, blank))
        else:
            peak, total, out = jax.lax.fori_loop(first, end, lambda block, state: fold(block, state)[1], init)
        total = jnp.maximum(total, jnp.finfo(jnp.float32).tiny)
        out = (out / total).transpose(0, 3, 1, 2, 4).reshape(tokens, num_kv_heads, group, head_dim)
        if weights is None:
            return out
        safe_peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
        query_weights = weights.reshape(num_blocks, query_block)

        def mass_of(logits):  # [b, H_kv, G, Q, S] -> [b, S, H_kv]
            return jnp.einsum("bhgqs,bq->bsh", jnp.exp(logits - safe_peak) / total, query_weights)

        if keep:
            return out, mass_of(kept)

        def mass_step(block, mass):
            logits, _ = self._block_logits(block, q, q_slots, rows, scale, logit_softcap)
            return jax.lax.dynamic_update_slice_in_dim(mass, mass_of(logits), block * span, axis=1)

        mass = jax.lax.fori_loop(first, end, mass_step, jnp.zeros((num_blocks, width, num_kv_heads), jnp.float32))
        return out, mass


@pytree_class
class PagedLayer(CacheLayer, PackedAttention, PagedStorage):
    """Paged K/V: pages ``[P, page_size, H_kv, D]`` shared by all rows, written and read through
    the block table of each step's ``PackedBatch``."""

    key_pages: PageArray  # [P, page_size, H_kv, D] (codes and scales when quantized)
    value_pages: PageArray
    window: int | None = struct.field(pytree_node=False, default=None)
    quantization: QuantSpec | None = struct.field(pytree_node=False, default=None)
    # [P, page_size, H_kv] float32: the attention mass each slot received since it was written
    # (``Paging.scored``; None: not kept). A slot starts at 0 when written; every query that reads
    # it adds its probability, summed over the query heads of the K/V head.
    slot_scores: jax.Array | None = None
    # [P, page_size, H_kv] int32: the position each slot holds, per K/V head (``Paging.compacted``;
    # None: slot s of a row's logical page j holds j * page_size + s). Set with the K/V when the
    # slot is written; a compaction moves it with them, per layer and K/V head, and sets -1 in a
    # slot it leaves empty. Meaningful only at a row's written slots (a freed page holds anything).
    slot_positions: jax.Array | None = None
    attention_backend: str = struct.field(pytree_node=False, default=XLA)  # see Paging
    layout: str = struct.field(pytree_node=False, default=TOKENS_LAYOUT)  # see Paging
    sharding: Layout | None = struct.field(pytree_node=False, default=None)  # see Paging
    # [P, C, H_kv, D] float32 (``Paging.retrieval``; None: not kept): per page and K/V head, the
    # element-wise min and max of its keys (minmax, C = 2) or their mean (centroid, C = 1), set by
    # the step that writes the page's last slot (``RetrievalLayer``'s ``page_summary`` of the stored
    # keys); only complete pages are scored, so a page still filling holds a stale one, unread.
    page_summaries: jax.Array | None = None
    retrieval: RetrievalSpec | None = struct.field(pytree_node=False, default=None)  # see Paging

    MEMORY_FORMULA = "2·P·page·H_kv·D·bytes; P pages (all rows share them)"
    WHY_NOT = {
        Rollback: "a paged layer keeps no lengths: the engine rolls a row back on the host",
        RowSelection: "a paged layer has no rows: the engine forks a row on the host (copy-on-write pages)",
    }

    @classmethod
    def create(
        cls, num_kv_heads: int, head_dim: int, paging: Paging, dtype=jnp.float32, window: int | None = None,
        quantization: QuantSpec | None = None,
    ) -> PagedLayer:  # fmt: skip
        """``quantization``: store the pages quantized (see ``check_page_quantization``)."""
        if quantization is not None:
            check_page_quantization(quantization, head_dim)
        pages = (paging.pool_pages(window), paging.page_size, num_kv_heads, head_dim)
        scored, compacted = paging.scored and window is None, paging.compacted and window is None
        retrieval = paging.retrieval if window is None else None
        summaries = None if retrieval is None else (pages[0], retrieval.summary_rows, num_kv_heads, head_dim)
        return cls(
            key_pages=empty_pool(pages, dtype, quantization, paging.layout),
            value_pages=empty_pool(pages, dtype, quantization, paging.layout),
            window=window,
            quantization=quantization,
            slot_scores=jnp.zeros(pages[:3], jnp.float32) if scored else None,
            slot_positions=jnp.full(pages[:3], -1, jnp.int32) if compacted else None,
            attention_backend=paging.attention_backend,
            layout=paging.layout,
            sharding=paging.sharding,
            page_summaries=None if summaries is None else jnp.zeros(summaries, jnp.float32),
            retrieval=retrieval,
        )

    @staticmethod
    def kv_bytes(batch_size, seq_len, num_kv_heads, head_dim, dtype, page_size: int = 16, **_) -> int:
        """Bytes of a pool holding exactly ``batch_size`` rows of ``seq_len`` tokens (plus the null page)."""
        pages = batch_size * -(-seq_len // page_size) + 1
        return pages * 2 * page_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize

    @property
    def page_size(self) -> int:
        return pool_shape(self.key_pages)[slot_and_head_axes(self.layout)[0]]

    @property
    def pool(self) -> str:
        """The pool name this layer's block table is under in a ``PackedBatch``."""
        return pool_name(self.window)

    @property
    def max_length(self) -> None:
        return None

    @property
    def head_dim(self) -> int:
        if self.quantization is None:
            return self.key_pages.shape[-1]
        return self.key_pages.codes.shape[-1] * 8 // self.quantization.bits

    def describe(self) -> str:
        quantized = f" {self.quantization.format}{self.quantization.bits}" if self.quantization else ""
        return f"page={self.page_size}" + (f" window={self.window}" if self.window else "") + quantized

    def logical_axes(self) -> PagedLayer:
        """Pages on ``pages`` (data parallel: each device keeps a share of the pool), K/V heads on ``kv_heads``."""
        lead = (PAGES, PAGE_SLOTS, KV_HEADS) if self.layout == TOKENS_LAYOUT else (PAGES, KV_HEADS, PAGE_SLOTS)

        def pool_axes(pool: PageArray):
            return pool.logical_axes(*lead) if isinstance(pool, QuantizedTensor) else Axes(*lead, HEAD_DIM)

        slots = Axes(PAGES, PAGE_SLOTS, KV_HEADS)  # slot scores and positions: [P, page, H_kv] in any layout
        summaries = None if self.page_summaries is None else Axes(PAGES, None, KV_HEADS, HEAD_DIM)
        return self.replace(
            key_pages=pool_axes(self.key_pages), value_pages=pool_axes(self.value_pages),
            slot_scores=None if self.slot_scores is None else slots,
            slot_positions=None if self.slot_positions is None else slots, page_summaries=summaries,
        )  # fmt: skip

    def with_page_copies(self, copies: dict) -> PagedLayer:
        source, destination = copies[self.pool][:, 0], copies[self.pool][:, 1]
        return jax.tree.map(lambda leaf: leaf.at[:, destination].set(leaf[:, source]), self)

    def page_scores(self, pages: jax.Array) -> jax.Array:
        if self.slot_scores is None:
            raise ValueError("page_scores: this pool keeps no slot scores (build it with Paging(scored=True))")
        return self.slot_scores[:, pages]

    def page_positions(self, pages: jax.Array) -> jax.Array:
        if self.slot_positions is None:
            raise ValueError("page_positions: this pool keeps no slot positions (build it with Paging(compacted=True))")
        return self.slot_positions[:, pages]

    def with_slots_moved(self, sources: tuple, destinations: tuple, kept: jax.Array, score_decay: float) -> PagedLayer:
        if self.slot_positions is None:
            raise ValueError(
                "with_slots_moved: this pool keeps no slot positions (build it with Paging(compacted=True))"
            )
        layers, _, _, heads = self.slot_positions.shape
        layer, head = jnp.arange(layers)[:, None, None, None], jnp.arange(heads)[None, None, None, :]
        source = (layer, *sources, head)  # [L, M, K, H_kv] each
        destination = (layer, destinations[0][None, :, :, None], destinations[1][None, :, :, None], head)

        def move(leaf: jax.Array) -> jax.Array:
            return leaf.at[_head_slot(self.layout, *destination)].set(leaf[_head_slot(self.layout, *source)])

        pools = jax.tree.map(move, (self.key_pages, self.value_pages))
        positions = jnp.where(kept, self.slot_positions[source], -1)
        moved = self.replace(
            key_pages=pools[0], value_pages=pools[1], slot_positions=self.slot_positions.at[destination].set(positions)
        )
        if self.slot_scores is None:
            return moved
        scores = jnp.where(kept, self.slot_scores[source] * score_decay, 0.0)
        return moved.replace(slot_scores=self.slot_scores.at[destination].set(scores))

    def page_keys(self, pages: jax.Array) -> jax.Array:
        return _tokens_major(_read(self.key_pages, (slice(None), pages), self.quantization), self.layout).astype(
            jnp.float32
        )

    def update_entry(self, index, keys, values, positions):
        raise TypeError(
            "a paged layer is written by the serving engine's packed batch: "
            "jaxkv.attention.cached_attention(..., packed=PackedBatch(...))"
        )

    def attend_packed_entry(
        self, index, queries, keys, values, positions, read: Callable, packed: PackedBatch
    ) -> tuple[PagedLayer, jax.Array]:
        """Write ``[1, H_kv, N, D]`` at ``positions`` ``[1, N]`` through the block table (token i of
        row ``batch.token_rows[i]``), then attend ``queries`` over the rows' pages (``read``, which
        lets the view read itself: ``PagedKVView.attend``).

        Padding (a negative position) and positions past the table's width land on the null
        page. Under ``jit`` nothing checks that a row owns the page a position maps to: the
        host page manager gives rows their pages before the step."""
        table = packed.block_tables[self.pool]
        page, offset = self._slots(table, packed.token_rows, keys, values, positions, packed.shifts.get(self.pool))

        def write(pool: PageArray, new: jax.Array) -> PageArray:
            stored = new if self.quantization is None else quantize(new, self.quantization, PER_TOKEN)
            slots = (index, *_slot(self.layout, page, offset))
            return jax.tree.map(lambda leaf, x: leaf.at[slots].set(x), pool, stored)

        new = self.replace(
            key_pages=write(self.key_pages, _flat(keys)), value_pages=write(self.value_pages, _flat(values))
        )
        if self.page_summaries is not None:
            new = new.replace(page_summaries=new._summarized(index, page, offset))
        if self.slot_positions is not None:
            new = new.replace(slot_positions=self.slot_positions.at[index, page, offset].set(positions.reshape(-1, 1)))
        view = PagedKVView(
            new.key_pages, new.value_pages, index, table, packed.token_rows, packed.decode_tokens, packed.decode_width,
            self.window, self.quantization, packed.shifts.get(self.pool), new.slot_positions,
            self.attention_backend, self.layout, self.sharding,
            packed.decode_pages if self.pool in packed.shifts else None, new.page_summaries, self.retrieval,
            None if self.retrieval is None else self._dense_queries(packed),
        )  # fmt: skip
        if self.slot_scores is None:
            out, _ = read(queries, view, positions, None)
            return new, out
        weights = (positions >= 0).astype(jnp.float32)
        if packed.score_weights is not None:
            weights = packed.score_weights.reshape(positions.shape)
        out, mass = read(queries, view, positions, weights)
        return new.replace(slot_scores=self._scored(index, table, view, page, offset, mass)), out

    def _dense_queries(self, packed: PackedBatch) -> jax.Array | None:
        """The tokens that read every page (``PackedBatch.dense_queries``), which ``prefill='dense'``
        needs and 'retrieve' refuses."""
        if (packed.dense_queries is None) != (self.retrieval.prefill == "retrieve"):
            raise ValueError(
                f"a pool retrieving with prefill={self.retrieval.prefill!r} needs PackedBatch.dense_queries "
                f"{'None' if self.retrieval.prefill == 'retrieve' else '(its prompt tokens)'}, got "
                f"{'None' if packed.dense_queries is None else 'an array'}"
            )
        return packed.dense_queries

    def _summarized(self, index, page: jax.Array, offset: jax.Array) -> jax.Array:
        """``page_summaries`` after the step wrote slots (``page``, ``offset``) ``[N]``: each page whose
        last slot was written is summarized from its stored keys (padding summarizes the null page,
        which no query scores)."""
        complete = jnp.where(offset == self.page_size - 1, page, NULL_PAGE)  # [N]
        keys = _entry_pages(self.key_pages, index, complete, self.quantization, self.layout)  # [N, page, H_kv, D]
        filled = jnp.ones((1, *keys.shape[:2], 1, 1), bool)
        summary = page_summary(self.retrieval.summary, keys[None].astype(jnp.float32), filled)[0]  # [N, H_kv, C, D]
        return self.page_summaries.at[index, complete].set(summary.swapaxes(1, 2))

    def _scored(self, index, table, view: PagedKVView, page, offset, masses) -> jax.Array:
        """``slot_scores`` after a step: the slots written now reset, then each query block's mass
        (``masses``: per part of ``query_block_rows``, ``[Z, C * page_size, H_kv]``) added at its
        row's first ``C`` pages."""
        scores = self.slot_scores.at[index, page, offset].set(0.0)
        for rows, mass in zip(view.query_block_rows(page.shape[0]), masses, strict=True):
            columns = mass.shape[1] // self.page_size
            pages = jnp.repeat(table[rows, :columns], self.page_size, axis=1)  # [Z, C * page_size]
            offsets = jnp.broadcast_to(jnp.arange(pages.shape[1]) % self.page_size, pages.shape)
            scores = scores.at[index, pages, offsets].add(mass)
        return scores

    def _slots(self, table, rows, keys, values, positions, shifts) -> tuple[jax.Array, jax.Array]:
        """Checked inputs: the page and offset each packed token is written to ``[N]`` (slot
        ``position - shifts[row]`` of its row; ``shifts`` None: its position)."""
        caller = f"{type(self).__name__}.update"
        heads = pool_shape(self.key_pages)[slot_and_head_axes(self.layout)[1]]
        dtype = keys.dtype if self.quantization else self.key_pages.dtype  # quantized: any float dtype
        for what, x in (("keys", keys), ("values", values)):
            check_array(caller, what, x, ("B", "H_kv", "T", "D"), (keys.shape[0], heads, None, self.head_dim), dtype)
        positions = jnp.asarray(positions, jnp.int32)
        if keys.shape != values.shape or positions.shape != keys.shape[:1] + keys.shape[2:3]:
            raise ValueError(
                f"{caller}: keys {keys.shape}, values {values.shape}, positions {positions.shape} disagree"
            )
        if positions.size != rows.shape[0]:
            raise ValueError(f"{caller}: {positions.size} tokens but the batch names the rows of {rows.shape[0]}")
        return page_slots(table, rows, positions.reshape(-1), shifts, self.page_size)

    def reset(self) -> PagedLayer:
        """Nothing per row to empty: rows are the host's (the pool's contents are masked by position)."""
        return self


def _flat(x: jax.Array) -> jax.Array:
    """``[B, H, T, D]`` -> ``[B * T, H, D]``, tokens row-major."""
    batch, heads, length, dim = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch * length, heads, dim)
