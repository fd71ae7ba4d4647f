"""A serving step's packed batch: the per-step metadata that travels beside the cache.

The serving engine packs the tokens of many rows into one ``[1, N]`` update: decode tokens of
many rows first (one per row, or with speculation a row's token and its drafts), then prefill
chunks in blocks of ``QUERY_BLOCK`` tokens of one row each. What each token belongs to
changes every step, so it is an argument of the step, handed
to the model beside the cache (``model(tokens, positions, cache, packed=...)``) and from there
to the layers that read it (``Cache.attend(..., packed=...)``); nothing of it is stored in the
cache. Jit contract: a traced argument of the compiled step whose shapes are fixed per
bucket; ``decode_tokens``, ``decode_width`` and ``tokens_per_row`` are static.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Self

import jax
from flax import struct

from jaxkv.protocol import Capability, pytree_class

# Query tokens of one row that read their row's pages together: a prefill chunk's tokens come
# in blocks of this many (gathering pages per token would read each page once per query token).
QUERY_BLOCK = 16


@pytree_class
class PackedBatch:
    """One step's packed tokens as the layers see them.

    ``token_rows`` ``[N]`` int32: the engine row (block-table row) of each packed token.
    ``block_tables``: per pool name (``'full'``, ``'sliding'``) ``[R, W]`` int32, row r's logical
    page j is pool page ``block_tables[pool][r, j]`` (the null page where it holds nothing).
    ``decode_tokens`` (static): the first tokens are decodes, in blocks of ``decode_width``
    (static; 1 unless the step verifies drafts: a row's token and its drafts) tokens of one row
    that read their row's pages together; the other ``N - decode_tokens`` come in blocks of
    ``QUERY_BLOCK`` tokens of one row. ``tokens_per_row`` (static): the most tokens one row
    brings in this step.
    ``shifts``: per pool name whose rows may hold compacted pages (an engine with
    ``max_pages_per_request``; empty: none), ``[R]`` int32 each row's shift (a token at position p
    is written to slot ``p - shift`` of its row; the pool keeps the position each slot holds).
    ``score_weights``: ``[N]`` float32 what each packed token's attention probabilities add to the
    slot scores of the pages it reads (``Paging.scored``; the compaction policy's,
    ``PageBudget.score_weights``); None: 1 for every real token.
    ``decode_pages`` (static): the most pages a decoding row holds in the pools named in
    ``shifts`` (the page budget's ``max_pages_per_request``: a row compacts before it would hold
    more), so their decode blocks read and score only the block table's columns up to it, not
    its whole width (a prompt prefilled whole may use that); None: the whole width.
    ``dense_queries``: ``[N]`` bool, the packed tokens that read every page of a retrieving pool
    (``Paging.retrieval`` with ``prefill='dense'``: its prompt tokens, wherever the step packs
    them); the others read their budget of pages. None: no such pool.
    """

    token_rows: jax.Array
    block_tables: dict
    decode_tokens: int = struct.field(pytree_node=False)
    tokens_per_row: int = struct.field(pytree_node=False)
    decode_width: int = struct.field(pytree_node=False, default=1)
    shifts: dict = struct.field(default_factory=dict)
    score_weights: jax.Array | None = None
    decode_pages: int | None = struct.field(pytree_node=False, default=None)
    dense_queries: jax.Array | None = None


class PackedAttention(Capability):
    """Capability of a layer that attends a packed batch (the engine's paged and per-row layers)."""

    ACTION = "attend a packed batch"

    @abc.abstractmethod
    def attend_packed_entry(
        self, index, queries, keys, values, positions, read: Callable, packed: PackedBatch
    ) -> tuple[Self, jax.Array]:
        """``attend_entry`` of ``[1, H, N, D]`` packed tokens at ``positions`` ``[1, N]``, token i of
        engine row ``packed.token_rows[i]``; returns the stack and the output ``[1, H_q, N, D]``."""


class PackedState(Capability):
    """Capability of a linear-attention layer fed a packed batch."""

    ACTION = "take a packed batch's update_state"

    @abc.abstractmethod
    def update_state_packed_entry(
        self, index, conv_inputs, positions, conv_fn: Callable, step_fn: Callable | None, packed: PackedBatch
    ) -> tuple[Self, Any]:
        """``update_state_entry`` of packed ``conv_inputs`` ``[1, N, C]`` at ``positions`` ``[1, N]``."""


class PagedStorage(Capability):
    """Capability of a layer whose K/V live in a page pool shared by the rows: ``pool`` names the
    block table it reads in a ``PackedBatch``; ``with_page_copies`` is a fork's copy-on-write."""

    ACTION = "copy pages"

    @property
    @abc.abstractmethod
    def pool(self) -> str:
        """The pool name (``'full'``, ``'sliding'``) of this layer's pages and block table."""

    @abc.abstractmethod
    def with_page_copies(self, copies: dict) -> Self:
        """This stack with page ``copies[pool][k, 1]`` set to page ``copies[pool][k, 0]`` in every
        entry (``[K, 2]`` int32 per pool name; a null-page self-copy is padding)."""

    @abc.abstractmethod
    def page_keys(self, pages: jax.Array) -> jax.Array:
        """The keys held in ``pages`` ``[M, K]`` by every entry: ``[L, M, K, page_size, H_kv, D]``
        float32 (dequantized), for a policy that scores tokens by their keys."""

    @abc.abstractmethod
    def page_scores(self, pages: jax.Array) -> jax.Array:
        """The attention mass the slots of ``pages`` ``[M, K]`` received in every entry:
        ``[L, M, K, page_size, H_kv]`` float32 (a pool that keeps slot scores)."""

    @abc.abstractmethod
    def page_positions(self, pages: jax.Array) -> jax.Array:
        """The position each slot of ``pages`` ``[M, K]`` holds in every entry, per K/V head:
        ``[L, M, K, page_size, H_kv]`` int32 (-1: empty; a pool whose rows may be compacted)."""

    @abc.abstractmethod
    def with_slots_moved(self, sources: tuple, destinations: tuple, kept: jax.Array, score_decay: float) -> Self:
        """This stack with, in entry l and K/V head h, slot ``(destinations[0][m, k],
        destinations[1][m, k])`` (page, offset ``[M, K]``) set to slot ``(sources[0][l, m, k, h],
        sources[1][l, m, k, h])`` (``[L, M, K, H_kv]``, or broadcast to it), all read before any is
        written; where ``kept`` (``[L, M, K, H_kv]``, broadcast) is False the slot is left empty
        (position -1). Moved slot scores are multiplied by ``score_decay``."""
