"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): the MLA latent cache plus the lightning
indexer's keys; each query attends only the ``index_topk`` tokens its indexer ranks highest.

Per token a layer stores the latent entry ``[R + P]`` (``jaxkv.mla``) and one
indexer key ``[D_I]`` (``index_head_dim``, a single head). A query ``t`` scores every visible
token ``s`` with ``sum_j w[t, j] · relu(q[t, j] · k[s])`` over the indexer's ``H_I`` heads
(``index_scores``), keeps its top ``index_topk`` (``select_slots``) and attends those only: the
chosen entries are gathered (``[B, T, K, R + P]``) and attention runs over them in the absorbed
form, so its cost follows ``K``, not ``S`` (transformers builds a dense ``[T, S]`` mask instead).
Scoring stays linear in ``S``: that is DSA's design, a cheap indexer in front of dense-quality
attention. While a layer holds no more slots than ``index_topk`` every visible token is chosen,
and the layer hands attention the plain latent view (the form chosen by cost, as MLA's).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.mla import (
    PAGE_AXES,
    GrowingSlots,
    LatentPages,
    LatentQueries,
    LatentSpec,
    LatentStorage,
    LatentView,
    LatentWeights,
    PagedLatentView,
    absorbed_attention,
    empty_pages,
    masked_softmax,
    write_pages,
)  # fmt: skip
from jaxkv.protocol import KV_AXES, MaskInfo, entry, pytree_class
from jaxkv.sharding import BATCH, Axes
from jaxkv.softmax import attention_mask


@pytree_class
class IndexerQueries:
    """The lightning indexer's side of a query: ``queries`` ``[B, T, H_I, D_I]`` (roped, scaled by
    ``D_I ** -0.5``) and the per-head ``weights`` ``[B, T, H_I]`` (scaled by ``H_I ** -0.5``)."""

    queries: jax.Array
    weights: jax.Array

    def per_row(self, unpack: Callable[[jax.Array, int], jax.Array]) -> IndexerQueries:
        """The queries with each array's token axis (1) laid out per row by ``unpack(x, axis)``."""
        return IndexerQueries(unpack(self.queries, 1), unpack(self.weights, 1))


@pytree_class
class IndexedQueries:
    """What a DSA layer's ``attend_entry`` takes as queries: the MLA queries and the indexer's."""

    latent: LatentQueries
    indexer: IndexerQueries

    def per_row(self, unpack: Callable[[jax.Array, int], jax.Array]) -> IndexedQueries:
        """Both halves laid out per row (``jaxkv.mla.LatentPages``)."""
        return IndexedQueries(self.latent.per_row(unpack), self.indexer.per_row(unpack))


def index_scores(indexer: IndexerQueries, index_keys: jax.Array) -> jax.Array:
    """``[B, T, S]`` float32: ``sum_j w[t, j] · relu(q[t, j] · k[s])`` against ``index_keys`` ``[B, S, D_I]``."""
    dots = jnp.einsum("bthd,bsd->bths", indexer.queries, index_keys, preferred_element_type=jnp.float32)
    return jnp.einsum("bth,bths->bts", indexer.weights.astype(jnp.float32), jax.nn.relu(dots))


def select_slots(indexer: IndexerQueries, index_keys, q_positions, mask_info: MaskInfo, topk: int):
    """Each query's ``min(topk, S)`` highest-scoring slots among those it may see: ``(slots, chosen)``,
    both ``[B, T, K]``; ``chosen`` is False where a query sees fewer than K tokens (the slot then
    filled by an unseen one, masked out)."""
    visible = attention_mask(q_positions, mask_info)  # [B, T, S]
    scores = jnp.where(visible, index_scores(indexer, index_keys), -jnp.inf)
    _, slots = jax.lax.top_k(scores, min(topk, scores.shape[-1]))
    return slots, jnp.take_along_axis(visible, slots, axis=-1)


@pytree_class
class SelectedView:
    """The latent entries each query chose: ``slots`` ``[B, T, K]`` of entry ``index`` of
    ``latent_stack`` ``[L, B, 1, S, R + P]``, ``chosen`` ``[B, T, K]`` (False: masked out)."""

    latent_stack: jax.Array
    index: jax.Array | int
    slots: jax.Array
    chosen: jax.Array

    def attend(self, queries: jax.Array, q_positions, *, scale: float) -> jax.Array:
        """Softmax attention of ``queries`` ``[B, H, T, R + P]`` over each query's own K gathered
        entries (keys and values both): ``[B, H, T, R + P]``. ``q_positions`` are already in ``chosen``."""
        gathered = self.gathered()
        logits = jnp.einsum("bhtw,btkw->bhtk", queries, gathered, preferred_element_type=jnp.float32)
        probs = masked_softmax(logits * scale, self.chosen[:, None])
        return jnp.einsum("bhtk,btkw->bhtw", probs.astype(gathered.dtype), gathered)

    def attend_latent(self, queries: LatentQueries, q_positions, weights: LatentWeights, scale: float) -> jax.Array:
        """``[B, H, T, v]``: the absorbed form over the chosen entries (expanding each query's own K
        entries per head would cost more than the gather saves)."""
        return absorbed_attention(queries, self, q_positions, weights, scale)

    def gathered(self) -> jax.Array:
        """The chosen entries ``[B, T, K, R + P]``, in one gather from the stack (slicing the entry
        out first would copy all S slots)."""
        rows = jnp.arange(self.slots.shape[0])[:, None, None]
        return self.latent_stack[self.index, rows, 0, self.slots]


@pytree_class
class PagedSelectedView(SelectedView):
    """``SelectedView`` of the engine's pages: ``latent_stack`` the pool ``[L, P, page_size, 1, R + P]``,
    ``slots`` ``[R, T, K]`` the rows' table slots, read through ``block_table`` ``[R, W]``: only the
    chosen entries are read from the pool."""

    block_table: jax.Array

    def gathered(self) -> jax.Array:
        size = self.latent_stack.shape[-3]
        rows = jnp.arange(self.slots.shape[0])[:, None, None]
        pages = self.block_table[rows, self.slots // size]  # [R, T, K]
        return self.latent_stack[self.index, pages, self.slots % size, 0]


def indexed_view(view: LatentView, index_keys, indexer: IndexerQueries, q_positions, topk: int):
    """What DSA's queries at ``q_positions`` ``[B, T]`` read of ``view`` (entries ``[.., S, R + P]``,
    indexer keys ``index_keys`` ``[B, S, D_I]``): a ``SelectedView`` of each query's ``topk``
    best slots, or ``view`` itself while ``S <= topk`` (every visible token is chosen)."""
    if view.key_stack.shape[-2] <= topk:
        return view
    slots, chosen = select_slots(indexer, index_keys, q_positions, view.mask_info, topk)
    return SelectedView(view.key_stack, view.index, slots, chosen)


@pytree_class
class IndexedLayer(LatentStorage):
    """DSA: MLA latent entries ``[B, 1, S_max, R + P]`` and the indexer's keys ``[B, 1, S_max, D_I]`` in fixed buffers.

    ``update(keys, values, positions)``: ``keys`` the latent entries ``[B, 1, T, R + P]``,
    ``values`` the indexer keys ``[B, 1, T, D_I]`` (one head). ``attend_entry`` takes
    ``IndexedQueries`` and hands ``read`` the MLA queries and a ``SelectedView`` (or, while the
    buffer holds at most ``index_topk`` slots, the plain ``LatentView``). Rollback, reorder,
    select and repeat carry the indexer keys with the latent (every leaf is batch-major).
    """

    index_keys: jax.Array  # [B, 1, S_max, D_I]
    index_topk: int = struct.field(pytree_node=False)

    MEMORY_FORMULA = "B·S_max·(R_kv+P+D_I)·bytes + 4·B"

    @classmethod
    def _empty(cls, batch_size: int, spec: LatentSpec, slots: int, dtype):
        if spec.index_dim is None or spec.index_topk is None:
            raise ValueError(
                f"{cls.__name__} needs the LatentSpec's index_dim and index_topk (index_head_dim, index_topk)"
            )
        latent = LatentStorage._empty(batch_size, spec, slots, dtype)
        index_keys = jnp.zeros((batch_size, 1, slots, spec.index_dim), dtype)
        return cls(latent=latent.latent, lengths=latent.lengths, index_keys=index_keys, index_topk=spec.index_topk)

    @classmethod
    def token_bytes(cls, spec: LatentSpec, dtype) -> int:
        return (spec.width + spec.index_dim) * jnp.dtype(dtype).itemsize

    def logical_axes(self):
        return self.replace(latent=KV_AXES, index_keys=KV_AXES, lengths=Axes(BATCH))

    def describe(self) -> str:
        return f"topk={self.index_topk}"

    def _checked(self, index, keys, values, positions):
        new = {
            "latent": self._checked_tokens("keys", keys),
            "index_keys": self._checked_tokens("values", values, "index_keys"),
        }
        return new, self._checked_positions(index, keys, positions)

    def attend_entry(self, index, queries: IndexedQueries, keys, values, positions, read):
        stack, view = self.update_entry(index, keys, values, positions)
        # the updated stack: a dynamic layer grew in the update
        view = indexed_view(view, entry(stack.index_keys, index)[:, 0], queries.indexer, positions, self.index_topk)
        out, _ = read(queries.latent, view, positions, None)
        return stack, out


@pytree_class
class DynamicIndexedLayer(GrowingSlots, IndexedLayer):
    """DSA: MLA latent entries ``[B, 1, N, R + P]`` and indexer keys ``[B, 1, N, D_I]`` whose capacity N grows."""

    SLOT_FIELDS = ("latent", "index_keys")
    MEMORY_FORMULA = "B·bucket(S)·(R_kv+P+D_I)·bytes + 4·B, bucket = next power of 2 (eager: exactly S)"


@pytree_class
class PagedIndexedLayer(LatentPages):
    """DSA in pages of the full pool: latent entries ``[P, page, 1, R + P]``, indexer keys ``[P, page, 1, D_I]``.

    The serving engine's variant (``jaxkv.mla.LatentPages``): each row's indexer keys are read
    with its entries, scored and the top ``index_topk`` gathered (``indexed_view``)."""

    index_pages: jax.Array  # [P, page_size, 1, D_I]
    index_topk: int = struct.field(pytree_node=False)

    MEMORY_FORMULA = "P·page·(R_kv+P+D_I)·bytes; P pages (all rows share them)"
    token_bytes = IndexedLayer.token_bytes

    @classmethod
    def create(cls, spec: LatentSpec, paging, dtype=jnp.float32) -> PagedIndexedLayer:
        """``paging``: a ``jaxkv.layers.paged.Paging``."""
        if spec.index_dim is None or spec.index_topk is None:
            raise ValueError(
                f"{cls.__name__} needs the LatentSpec's index_dim and index_topk (index_head_dim, index_topk)"
            )
        return cls(
            latent_pages=empty_pages(paging, spec.width, dtype),
            index_pages=empty_pages(paging, spec.index_dim, dtype),
            index_topk=spec.index_topk,
        )

    def describe(self) -> str:
        return f"page={self.page_size} topk={self.index_topk}"

    def logical_axes(self):
        return self.replace(latent_pages=PAGE_AXES, index_pages=PAGE_AXES)

    def _written(self, index, page, offset, keys, values):
        if values is None:
            raise ValueError(f"{type(self).__name__}.update: values (the indexer keys [1, 1, N, D_I]) is None")
        return self.replace(
            latent_pages=write_pages(self.latent_pages, index, page, offset, keys, "keys"),
            index_pages=write_pages(self.index_pages, index, page, offset, values, "values"),
        )

    def _read_rows(self, index, table, queries: IndexedQueries, row_positions, read) -> jax.Array:
        """While the table holds at most ``index_topk`` slots, the rows' view; past that the indexer
        scores the slots up to the furthest query's block (``paged_select``) and only the chosen
        entries are read from the pool."""
        view = self.rows_view(index, table, row_positions)
        if view.shape[2] > self.index_topk:
            keys = PagedLatentView(self.index_pages, self.index_pages, index, view.mask_info, table)
            slots, chosen = paged_select(queries.indexer, keys, row_positions, self.index_topk)
            view = PagedSelectedView(self.latent_pages, index, slots, chosen, table)
        out, _ = read(queries.latent, view, row_positions, None)
        return out


def paged_select(indexer: IndexerQueries, keys: PagedLatentView, q_positions, topk: int):
    """``select_slots`` over the indexer keys of ``keys`` (a view ``[R, 1, S, D_I]`` read block by
    block up to its ``mask_info.slots_used``), with a running top-k: each block's scores are
    merged with the best ``topk`` so far. Ties go to the lower slot as in one ``top_k`` over all
    slots (the kept ones precede a block's, and ``top_k`` keeps the first of equals), so the
    choice is the same. ``(slots, chosen)`` ``[R, T, topk]``."""
    mask_info, block = keys.mask_info, keys.block_slots
    rows, length = q_positions.shape

    def step(start, best):
        scores, slots = best
        found, _ = keys.read(start * block, block)  # [R, 1, block, D_I]
        held = jax.lax.dynamic_slice_in_dim(mask_info.kv_positions, start * block, block, axis=1)
        visible = attention_mask(q_positions, MaskInfo(held))  # [R, T, block]
        new = jnp.where(visible, index_scores(indexer, found[:, 0]), -jnp.inf)
        ids = jnp.broadcast_to(start * block + jnp.arange(block, dtype=jnp.int32), new.shape)
        scores, at = jax.lax.top_k(jnp.concatenate([scores, new], axis=-1), topk)
        return scores, jnp.take_along_axis(jnp.concatenate([slots, ids], axis=-1), at, axis=-1)

    init = jnp.full((rows, length, topk), -jnp.inf, jnp.float32), jnp.zeros((rows, length, topk), jnp.int32)
    num_blocks = (mask_info.slots_used + block - 1) // block
    scores, slots = jax.lax.fori_loop(0, num_blocks, step, init)
    return slots, scores > -jnp.inf
