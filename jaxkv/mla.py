"""MLA's shared pieces (``jaxkv.layers.latent``, ``jaxkv.layers.indexed`` build on them): what a
token stores (``LatentSpec``), the queries and up-projection attention reads with, the two
attention forms and the slot storage of the latent entries.

Multi-head latent attention compresses each token's K/V into one latent ``c`` of ``R``
(``kv_lora_rank``) values plus one RoPE key ``k_r`` of ``P`` (``qk_rope_head_dim``) shared by
every head. A head's key is ``[W_uk[h] c, k_r]`` and its value ``W_uv[h] c`` (``kv_b_proj``), so
the cache keeps ``[c, k_r]``: ``R + P`` values a token (DeepSeek-V3: 512 + 64 = 576 against
``2 · 128 · 128 = 32,768`` for its 128 full heads, 56.9x less), one buffer ``[B, 1, S, R + P]``
read as a single K/V head (MQA).

Two ways to attend over it (``LatentView.attend_latent`` picks by a static cost rule):

* absorbed (``absorbed_attention``): each query is taken into the latent space
  (``q_nope · W_uk[h]``, then ``[.., q_rope]``), attends over the stored entries as one K/V head
  of width ``R + P``, and the output's latent part leaves through ``W_uv[h]``. Nothing is
  expanded per stored token, so a decode step reads ``R + P`` values a token: what decode uses.
* plain (``expanded_attention``): every stored latent expanded into per-head keys and values,
  then ordinary attention of width ``qk_nope + P`` (values ``v``). It pays the expansion once
  per slot, its products are narrower: cheaper once a call brings enough queries (a prefill).

The rule (``prefers_expanded``, flops of one call, ``T`` queries, ``S`` slots, ``H`` heads):
absorbed ``T·H·R·(n+v) + 2·T·S·H·(R+P)``, plain ``S·H·R·(n+v) + c·T·S·H·(n+P+v)``, where
``c = PLAIN_FLOP_COST`` is what a flop of the plain form's products costs against the absorbed
form's blocked read, measured on this 2-core CPU (float32, H 16, R 128, P 32, n = v = 64, 1024
slots, machine shared; ms per call, absorbed / plain): T=1 0.58 / 18.7, T=16 6.7 / 19.9, T=64
19.2 / 33.9, T=256 84 / 161, T=1024 443 / 619: at those shapes (attention widths 2·160 against
160, a ratio under ``c``) the absorbed form serves decode and prefill alike. DeepSeek-V3's shapes
(widths 2·576 against n+P+v = 320, a ratio of 3.6) decode absorbed and expand a prefill of more
than about 455 queries (``S`` large).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.batch import PackedAttention, PackedBatch, PagedStorage
from jaxkv.page_table import FULL_POOL, NULL_PAGE, block_pages, page_slots
from jaxkv.protocol import (
    KV_AXES,
    BatchMajorLayer,
    CacheLayer,
    Growth,
    KVView,
    MaskInfo,
    Overflow,
    Rollback,
    RowPacking,
    RowSelection,
    check_array,
    check_capacity,
    check_positions,
    entry,
    is_traced,
    lengths_after,
    pytree_class,
    write_slots,
)  # fmt: skip
from jaxkv.sharding import BATCH, HEAD_DIM, KV_HEADS, PAGE_SLOTS, PAGES, Axes, to_host
from jaxkv.sizing import bucket
from jaxkv.softmax import attention_mask


@dataclasses.dataclass(frozen=True)
class LatentSpec:
    """What an MLA layer stores per token: the latent's ``rank`` (``kv_lora_rank``) and the shared
    RoPE key's ``rope_dim`` (``qk_rope_head_dim``); for DSA (``jaxkv.layers.indexed``) also the
    indexer's key width ``index_dim`` (``index_head_dim``) and the tokens a query attends
    ``index_topk``."""

    rank: int
    rope_dim: int
    index_dim: int | None = None
    index_topk: int | None = None

    def __post_init__(self):
        for name in ("rank", "rope_dim", "index_dim", "index_topk"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"LatentSpec: {name} must be positive, got {value}")

    @property
    def width(self) -> int:
        """``R + P``: the values stored per token."""
        return self.rank + self.rope_dim


@pytree_class
class LatentWeights:
    """The up-projection an MLA layer attends through: ``kv_b_proj`` as ``[H, n + v, R]`` (per head
    the key rows ``W_uk[h]`` ``[n, R]``, then the value rows ``W_uv[h]`` ``[v, R]``)."""

    up: jax.Array  # [H, n + v, R]
    nope_dim: int = struct.field(pytree_node=False)

    @property
    def key_up(self) -> jax.Array:
        """``W_uk`` ``[H, n, R]``."""
        return self.up[:, : self.nope_dim]

    @property
    def value_up(self) -> jax.Array:
        """``W_uv`` ``[H, v, R]``."""
        return self.up[:, self.nope_dim :]


@pytree_class
class LatentQueries:
    """An MLA layer's queries: ``nope`` ``[B, H, T, n]`` and the roped ``rope`` ``[B, H, T, P]``."""

    nope: jax.Array
    rope: jax.Array

    def absorbed(self, weights: LatentWeights) -> jax.Array:
        """``[B, H, T, R + P]``: the query in the latent space (``q_nope · W_uk[h]``), then its RoPE part."""
        latent = jnp.einsum("bhtn,hnr->bhtr", self.nope, weights.key_up)
        return jnp.concatenate([latent, self.rope.astype(latent.dtype)], axis=-1)

    def per_row(self, unpack: Callable[[jax.Array, int], jax.Array]) -> LatentQueries:
        """The queries with each array's token axis (2) laid out per row by ``unpack(x, axis)``."""
        return LatentQueries(unpack(self.nope, 2), unpack(self.rope, 2))


PLAIN_FLOP_COST = 2.7  # measured (module docstring): the plain form's attention flops cost 2.7 absorbed ones


def prefers_expanded(num_queries: int, num_slots: int, heads: int, rank: int, rope_dim: int, weights) -> bool:
    """Whether the plain form costs less than the absorbed one (module docstring)."""
    nope, value = weights.nope_dim, weights.up.shape[1] - weights.nope_dim
    absorbed = num_queries * heads * rank * (nope + value) + 2 * num_queries * num_slots * heads * (rank + rope_dim)
    attention = num_queries * num_slots * heads * (nope + rope_dim + value)
    expanded = num_slots * heads * rank * (nope + value) + PLAIN_FLOP_COST * attention
    return expanded < absorbed


def absorbed_attention(queries: LatentQueries, view, q_positions, weights: LatentWeights, scale: float) -> jax.Array:
    """``[B, H, T, v]``: attention in the latent space over ``view`` (its ``attend`` reads the
    entries ``[.., R + P]`` as one K/V head: keys and values both, the values' RoPE part dropped
    after), the latent output taken out through ``W_uv``."""
    rank = weights.up.shape[-1]
    latent_out = view.attend(queries.absorbed(weights), q_positions, scale=scale)[..., :rank]
    return jnp.einsum("bhtr,hvr->bhtv", latent_out, weights.value_up)


def expanded_attention(queries: LatentQueries, view: KVView, q_positions, weights: LatentWeights, scale: float):
    """``[B, H, T, v]``: every stored latent of ``view`` expanded into per-head keys ``[W_uk c, k_r]``
    and values ``W_uv c``, then softmax attention (float32 logits) masked by the view's positions."""
    rank = weights.up.shape[-1]
    entries = view.keys[:, 0]  # [B, S, R + P]
    latent, rope_key = entries[..., :rank], entries[..., rank:]
    keys = jnp.einsum("bsr,hnr->bhsn", latent, weights.key_up)
    values = jnp.einsum("bsr,hvr->bhsv", latent, weights.value_up)
    logits = jnp.einsum("bhtn,bhsn->bhts", queries.nope, keys, preferred_element_type=jnp.float32)
    logits += jnp.einsum("bhtp,bsp->bhts", queries.rope, rope_key, preferred_element_type=jnp.float32)
    probs = masked_softmax(logits * scale, attention_mask(q_positions, view.mask_info)[:, None])
    return jnp.einsum("bhts,bhsv->bhtv", probs.astype(values.dtype), values)


def masked_softmax(logits: jax.Array, visible: jax.Array) -> jax.Array:
    """Softmax of ``logits`` over the last axis where ``visible`` (broadcast to them); a query that
    sees nothing (padding) gets zeros, not NaN."""
    logits = jnp.where(visible, logits, -jnp.inf)
    top = jnp.max(logits, axis=-1, keepdims=True)
    weights = jnp.where(visible, jnp.exp(logits - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    return weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)


@pytree_class
class LatentView(KVView):
    """What a latent layer's update returns: the entries ``[B, 1, S, R + P]`` as one K/V head (keys
    and values are the same buffer) and their ``MaskInfo``."""

    def read(self, start, size: int) -> tuple[jax.Array, jax.Array]:
        """Entries ``[B, 1, size, R + P]`` of slots ``[start, start + size)``, read once as keys and values."""
        _, batch, heads, _, width = self.key_stack.shape
        block = jax.lax.dynamic_slice(self.key_stack, (self.index, 0, 0, start, 0), (1, batch, heads, size, width))[0]
        return block, block

    def attend_latent(self, queries: LatentQueries, q_positions, weights: LatentWeights, scale: float) -> jax.Array:
        """``[B, H, T, v]``, in the form ``prefers_expanded`` finds cheaper for this call's shapes."""
        _, heads, num_queries, _ = queries.nope.shape
        rank = weights.up.shape[-1]
        rope_dim = self.shape[-1] - rank
        if prefers_expanded(num_queries, self.shape[2], heads, rank, rope_dim, weights):
            return expanded_attention(queries, self, q_positions, weights, scale)
        return absorbed_attention(queries, self, q_positions, weights, scale)


@pytree_class
class PagedLatentView(LatentView):
    """``LatentView`` of the rows' pages: ``key_stack`` (= ``value_stack``) the pool ``[L, P,
    page_size, 1, R + P]`` at entry ``index``, ``block_table`` ``[R, W]``; its slots are the rows'
    table slots ``[R, 1, W * page_size, R + P]``. ``read`` gathers the pages of one block of slots,
    so blocked attention (the absorbed form) reads the page blocks up to ``mask_info.slots_used``
    (the furthest query's) and never the rest of the table; ``keys`` (the plain form's) gathers
    every slot."""

    block_table: jax.Array
    computed_reads = True  # a block is gathered from pages

    @property
    def block_slots(self) -> int:
        """The slots a block read covers: whole pages (``block_pages``), a divisor of the table's slots."""
        page_size = self.key_stack.shape[-3]
        return block_pages(page_size) * page_size

    def attend(self, queries, q_positions, *, scale: float, logit_softcap=None, block_size=None, query_weights=None):
        """``SlotView.attend`` in blocks of ``block_slots`` unless ``block_size`` says."""
        options = dict(logit_softcap=logit_softcap, query_weights=query_weights)
        return super().attend(queries, q_positions, scale=scale, block_size=block_size or self.block_slots, **options)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        rows, width = self.block_table.shape
        return rows, 1, width * self.key_stack.shape[-3], self.key_stack.shape[-1]

    @property
    def keys(self) -> jax.Array:
        return self._slots(jnp.arange(self.shape[2], dtype=jnp.int32))

    values = keys

    def read(self, start, size: int) -> tuple[jax.Array, jax.Array]:
        block = self._slots(start + jnp.arange(size, dtype=jnp.int32))
        return block, block

    def _slots(self, slots: jax.Array) -> jax.Array:
        """Every row's entries ``[R, 1, n, R + P]`` at table slots ``slots`` ``[n]``."""
        page_size = self.key_stack.shape[-3]
        pages = self.block_table[:, slots // page_size]  # [R, n]
        return self.key_stack[self.index, pages, slots % page_size].swapaxes(1, 2)


@pytree_class
class LatentStorage(BatchMajorLayer, Rollback, Overflow):
    """Latent entries ``[B, 1, S, R + P]`` in a fixed buffer (what every latent layer builds on).

    ``update(keys, values, positions)``: ``keys`` are the new tokens' entries ``[B, 1, T, R + P]``;
    ``values`` must be None (the latent is key and value both). Slot ``p`` holds position ``p``,
    as in ``StaticLayer`` (overflow under jit: dropped and reported by ``overflowed``).
    """

    latent: jax.Array  # [B, 1, S_max, R + P]
    lengths: jax.Array  # [B] int32

    @classmethod
    def create(cls, batch_size: int, spec: LatentSpec, max_length: int, dtype=jnp.float32):
        if max_length <= 0:
            raise ValueError(f"{cls.__name__}: max_length must be positive, got {max_length}")
        return cls._empty(batch_size, spec, max_length, dtype)

    @classmethod
    def _empty(cls, batch_size: int, spec: LatentSpec, slots: int, dtype):
        return cls(
            latent=jnp.zeros((batch_size, 1, slots, spec.width), dtype), lengths=jnp.zeros((batch_size,), jnp.int32)
        )

    @classmethod
    def token_bytes(cls, spec: LatentSpec, dtype) -> int:
        """Bytes one token takes in one layer."""
        return spec.width * jnp.dtype(dtype).itemsize

    @classmethod
    def kv_bytes(cls, batch_size, seq_len, num_kv_heads, head_dim, dtype, max_length=None, *, latent, **_) -> int:
        """Bytes for a buffer preallocated to ``max_length`` (default ``seq_len``); ``latent`` a ``LatentSpec``."""
        return batch_size * (max_length or seq_len) * cls.token_bytes(latent, dtype) + 4 * batch_size

    @property
    def capacity(self) -> int:
        return self.latent.shape[-2]

    @property
    def max_length(self) -> int | None:
        return self.capacity

    @property
    def overflowed(self) -> jax.Array:
        return self.lengths > self.capacity

    def logical_axes(self):
        return self.replace(latent=KV_AXES, lengths=Axes(BATCH))

    def reset(self):
        return jax.tree.map(jnp.zeros_like, self)

    def update_entry(self, index, keys, values, positions):
        new, positions = self._checked(index, keys, values, positions)
        check_capacity(self, positions, self.capacity)
        return self._write(index, new, positions)

    def _checked(self, index, keys, values, positions) -> tuple[dict, jax.Array]:
        """The buffers' new entries by field name, and the positions as int32 (checked)."""
        if values is not None:
            raise ValueError(
                f"{type(self).__name__}.update: values must be None: the latent entry (keys [B, 1, T, R + P]) is "
                f"both key and value"
            )
        return {"latent": self._checked_tokens("keys", keys)}, self._checked_positions(index, keys, positions)

    def _checked_tokens(self, what: str, x: jax.Array | None, field: str = "latent") -> jax.Array:
        stored = getattr(self, field)
        width, layout = stored.shape[-1], ("B", "1", "T", "R + P" if field == "latent" else "D_I")
        if x is None:
            raise ValueError(f"{type(self).__name__}.update: {what} is None, expected [{', '.join(layout)}]")
        expected = (stored.shape[-4], 1, None, width)
        check_array(f"{type(self).__name__}.update", what, x, layout, expected, stored.dtype)
        return x

    def _checked_positions(self, index, keys, positions) -> jax.Array:
        shape = (keys.shape[0], keys.shape[2])
        return check_positions(f"{type(self).__name__}.update", positions, shape, self.lengths, index)

    def _write(self, index, new: dict, positions) -> tuple[LatentStorage, LatentView]:
        """``new`` (field -> ``[B, 1, T, D]``) written at slot = position in entry ``index``."""
        slots = jnp.where(positions >= 0, positions, self.capacity)
        lengths = lengths_after(entry(self.lengths, index), positions)
        written = {name: self._write_field(name, index, x, slots) for name, x in new.items()}
        layer = self.replace(lengths=self.lengths.at[index].set(lengths), **written)
        slot_index = jnp.arange(self.capacity, dtype=jnp.int32)[None, :]
        kv_positions = jnp.where(slot_index < lengths[:, None], slot_index, -1)
        mask_info = MaskInfo(kv_positions, slots_used=jnp.minimum(jnp.max(lengths), self.capacity))
        stack, stack_index = layer._read_entries(index)
        return layer, LatentView(stack, stack, stack_index, mask_info)

    def _write_field(self, name: str, index, x: jax.Array, slots) -> jax.Array:
        """Buffer ``name`` with ``x`` ``[B, 1, T, D]`` written at ``slots`` ``[B, T]`` of entry ``index``."""
        return write_slots(getattr(self, name), index, x, slots)

    def _read_entries(self, index) -> tuple[jax.Array, jax.Array | int]:
        """The stack of entries attention reads ``[L, B, 1, S, R + P]`` and entry ``index``'s place in it."""
        return self.latent, index


class GrowingSlots(Growth):
    """A latent layer whose slots grow (the dynamic variants): eagerly an update grows the buffers to
    what the rows need; under jit ``Cache.reserve`` grows them beforehand, in powers of two."""

    SLOT_FIELDS = ("latent",)

    @classmethod
    def create(cls, batch_size: int, spec: LatentSpec, dtype=jnp.float32, capacity: int = 0):
        return cls._empty(batch_size, spec, capacity, dtype)

    @classmethod
    def kv_bytes(cls, batch_size, seq_len, num_kv_heads, head_dim, dtype, *, latent, **_) -> int:
        """Bytes once ``seq_len`` tokens were reserved in buckets; ``latent`` a ``LatentSpec``."""
        return batch_size * bucket(seq_len) * cls.token_bytes(latent, dtype) + 4 * batch_size

    def grow(self, capacity: int):
        extra = capacity - self.capacity
        if extra <= 0:
            return self

        def padded(x: jax.Array) -> jax.Array:  # [..., S, D] -> [..., S + extra, D]
            return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, extra), (0, 0)])

        return self.replace(**{name: padded(getattr(self, name)) for name in self.SLOT_FIELDS})

    @property
    def max_length(self) -> None:
        return None

    def update_entry(self, index, keys, values, positions):
        if is_traced(positions, index):
            if jnp.shape(positions)[1] > self.capacity:
                raise ValueError(
                    f"{type(self).__name__}.update under jit: {jnp.shape(positions)[1]} new tokens exceed the "
                    f"capacity {self.capacity}; call cache.reserve({jnp.shape(positions)[1]}) before the jitted step"
                )
            return super().update_entry(index, keys, values, positions)
        grown = self.grow(int(np.max(to_host(jnp.asarray(positions)), initial=-1)) + 1)
        return super(GrowingSlots, grown).update_entry(index, keys, values, positions)


PAGE_AXES = Axes(PAGES, PAGE_SLOTS, KV_HEADS, HEAD_DIM)


@pytree_class
class LatentPages(CacheLayer, PackedAttention, PagedStorage):
    """Latent entries in the serving engine's full pool: pages ``[P, page_size, 1, R + P]`` shared by
    all rows, read through each step's block table (what ``PagedLatentLayer`` and DSA's
    ``PagedIndexedLayer`` build on).

    The same block table, page size and page ids as a Llama's K/V pages, every leaf's pages on
    axis 1: the engine's host page manager shares prefix pages (the prefix cache), forks them
    copy-on-write, preempts and swaps them to the host tier as for ``PagedLayer``. Slot ``s`` of a
    row's logical page ``j`` holds position ``j * page_size + s``; the null page reads as empty.

    A step writes its packed tokens through the table (``page_slots``), lays the queries out per
    row (``RowPacking``) and reads (``_read_rows``) each row's table slots as a ``PagedLatentView``:
    the absorbed form reads it block by block, each block's pages gathered from the pool, up to the
    furthest query's block (as ``PagedKVView``: a decode step's cost follows the filled length,
    not ``max_model_len``); the plain form (a long prefill) gathers the whole table once. DSA past
    ``index_topk`` slots scores the indexer keys block by block up to the same block, keeping a
    running top-k, then reads the chosen entries only. Compacted rows (shifted slots) are refused;
    the Pallas kernels do not read these pages.
    """

    latent_pages: jax.Array  # [P, page_size, 1, R + P]

    WHY_NOT: ClassVar[dict] = {
        Rollback: "a paged layer keeps no lengths: the engine rolls a row back on the host",
        RowSelection: "a paged layer has no rows: the engine forks a row on the host (copy-on-write pages)",
    }

    @classmethod
    def create(cls, spec: LatentSpec, paging, dtype=jnp.float32):
        """``paging``: a ``jaxkv.layers.paged.Paging`` (its full pool's ``num_pages`` and ``page_size``)."""
        return cls(latent_pages=empty_pages(paging, spec.width, dtype))

    @classmethod
    def kv_bytes(cls, batch_size, seq_len, num_kv_heads, head_dim, dtype, page_size: int = 16, *, latent, **_) -> int:
        """Bytes of a pool holding exactly ``batch_size`` rows of ``seq_len`` tokens (plus the null page)."""
        return (batch_size * -(-seq_len // page_size) + 1) * page_size * cls.token_bytes(latent, dtype)

    @classmethod
    def token_bytes(cls, spec: LatentSpec, dtype) -> int:
        """Bytes one token takes in one layer."""
        return spec.width * jnp.dtype(dtype).itemsize

    @property
    def page_size(self) -> int:
        return self.latent_pages.shape[-3]

    @property
    def pool(self) -> str:
        return FULL_POOL

    @property
    def max_length(self) -> None:
        return None

    def describe(self) -> str:
        return f"page={self.page_size}"

    def logical_axes(self):
        return self.replace(latent_pages=PAGE_AXES)

    def reset(self):
        """Nothing per row to empty: rows are the host's (the pool's contents are masked by position)."""
        return self

    def update_entry(self, index, keys, values, positions):
        raise TypeError(
            f"{type(self).__name__} is written by the serving engine's packed batch: "
            "Cache.attend(..., packed=PackedBatch(...))"
        )

    def attend_entry(self, index, queries, keys, values, positions, read):
        raise TypeError(
            f"{type(self).__name__} serves the engine's packed batch: Cache.attend(..., packed=PackedBatch)"
        )

    def with_page_copies(self, copies: dict):
        source, destination = copies[self.pool][:, 0], copies[self.pool][:, 1]
        return jax.tree.map(lambda leaf: leaf.at[:, destination].set(leaf[:, source]), self)

    def page_keys(self, pages: jax.Array) -> jax.Array:
        """The latent entries of ``pages`` ``[M, K]``: ``[L, M, K, page_size, 1, R + P]`` float32."""
        return self.latent_pages[:, pages].astype(jnp.float32)

    def page_scores(self, pages: jax.Array) -> jax.Array:
        raise ValueError(f"{type(self).__name__} keeps no slot scores: compaction does not cover latent pages")

    def page_positions(self, pages: jax.Array) -> jax.Array:
        raise ValueError(f"{type(self).__name__} keeps no slot positions: compaction does not cover latent pages")

    def with_slots_moved(self, sources: tuple, destinations: tuple, kept: jax.Array, score_decay: float):
        raise ValueError(f"{type(self).__name__}: compaction (moving slots) does not cover latent pages")

    def attend_packed_entry(self, index, queries, keys, values, positions, read: Callable, packed: PackedBatch):
        """Write the entries ``keys`` ``[1, 1, N, R + P]`` (and DSA's indexer keys ``values``
        ``[1, 1, N, D_I]``) of the packed tokens at ``positions`` ``[1, N]`` through the block
        table, then attend ``queries`` (``LatentQueries`` or DSA's, token axis per array) over each
        token's row: the output ``[1, H, N, v]``."""
        if packed.shifts.get(self.pool) is not None:
            raise ValueError(f"{type(self).__name__}: compacted rows (shifted slots) are not supported")
        table = packed.block_tables[self.pool]
        page, offset = page_slots(table, packed.token_rows, positions[0], None, self.page_size)
        new = self._written(index, page, offset, keys, values)
        packing = RowPacking.of(packed.token_rows, positions[0], table.shape[0], packed.tokens_per_row)

        def unpack(x: jax.Array, axis: int) -> jax.Array:  # [1, ..., N (at axis), ...] -> [R, ..., T, ...]
            rows = packing.unpacked(jnp.moveaxis(x[0], axis - 1, 0), 0)  # [R, T, ...]
            return jnp.moveaxis(rows, 1, axis)

        row_positions = packing.unpacked(positions[0], -1)  # [R, T]
        out = new._read_rows(index, table, queries.per_row(unpack), row_positions, read)  # [R, H, T, v]
        return new, jnp.moveaxis(packing.packed(jnp.moveaxis(out, 2, 1)), 1, 0)[None]

    def _written(self, index, page, offset, keys, values):
        """The pages with the entries written at ``(page, offset)`` ``[N]`` of entry ``index``."""
        if values is not None:
            raise ValueError(
                f"{type(self).__name__}.update: values must be None: the latent entry (keys [1, 1, N, R + P]) is "
                "both key and value"
            )
        return self.replace(latent_pages=write_pages(self.latent_pages, index, page, offset, keys, "keys"))

    def rows_view(self, index, table, row_positions) -> PagedLatentView:
        """Each row's table slots read through ``table`` ``[R, W]`` by queries at ``row_positions``
        ``[R, T]``: entries ``[R, 1, W * page_size, R + P]``, read up to the furthest query's block."""
        return PagedLatentView(self.latent_pages, self.latent_pages, index, self.rows_mask(table, row_positions), table)

    def rows_mask(self, table, row_positions) -> MaskInfo:
        """The positions ``[R, W * page_size]`` the rows' table slots hold (-1 on the null page),
        in use up to the furthest of ``row_positions`` ``[R, T]``."""
        width, size = table.shape[1], self.page_size
        held = jnp.repeat(table != NULL_PAGE, size, axis=1)
        kv_positions = jnp.where(held, jnp.arange(width * size, dtype=jnp.int32)[None], -1)
        return MaskInfo(kv_positions, slots_used=jnp.clip(jnp.max(row_positions) + 1, 0, width * size))

    def _read_rows(self, index, table, queries, row_positions, read) -> jax.Array:
        """``[R, H, T, v]``: ``read`` of the per-row ``queries`` at ``row_positions`` ``[R, T]``."""
        out, _ = read(queries, self.rows_view(index, table, row_positions), row_positions, None)
        return out


def empty_pages(paging, width: int, dtype) -> jax.Array:
    """``[P, page_size, 1, width]`` zeros: the full pool's pages (``paging`` a ``jaxkv.layers.paged.Paging``)."""
    return jnp.zeros((paging.num_pages, paging.page_size, 1, width), dtype)


def write_pages(pages: jax.Array, index, page, offset, new: jax.Array, what: str) -> jax.Array:
    """``pages`` ``[L, P, page_size, 1, D]`` with ``new`` ``[1, 1, N, D]`` at ``(page, offset)`` ``[N]`` of entry ``index``."""
    expected = (1, 1, page.shape[0], pages.shape[-1])
    check_array("LatentPages.update", what, new, ("1", "1", "N", "D"), expected, pages.dtype)
    return pages.at[index, page, offset].set(new[0, 0][:, None])
