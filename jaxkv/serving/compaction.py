"""Compressed pages (Zipage, arXiv 2603.08743): token eviction inside the engine's pages.

With ``max_pages_per_request`` (``PageBudget``) a request holds at most that many pages of the
full-attention pool. When its next tokens would need one more, the KV manager plans a
compaction (``Compaction``): every token the request holds is scored by a policy, the best
``keep_slots`` (``(max_pages - 1) * page_size``: sinks and the recent window always, as
``EvictingLayer`` keeps them, ``jaxkv.layers.evicting.kept_order``) are copied, in position order,
into ``max_pages - 1`` pages, and its other pages go back to the pool. One compiled function
(``compact_pages``) compacts up to ``MAX_COMPACTIONS`` rows between two steps (padded to one of
``COMPACTION_ROWS``); a row beyond that waits a step. The kept keys keep the positions RoPE gave
them; the row's slots now hold non-contiguous positions, which the host keeps
(``KVCacheManager.row_positions``) and the step masks by. One choice of tokens holds for every
layer and K/V head of the pool (one block table).

Pages others may read are never written: the destinations are the request's own pages that no
other request holds, reused in place (those the prefix cache holds only past its prompt: they
leave the cache), else fresh pages; a shared page, or a cached page of the prompt, is only read
(its tokens are copied, it keeps its other owners or its cache entry).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.batch import PagedStorage
from jaxkv.cache import Cache
from jaxkv.eviction import EvictionSpec, window_scores
from jaxkv.layers.evicting import kept_order
from jaxkv.layers.paged import FULL_POOL, NULL_PAGE
from jaxkv.protocol import has

# Policies a compaction ranks by: the position, the key, or the attention each slot received
# (``PagedLayer.slot_scores``, kept by the step: H2O's sum over every query since the token was
# written; Zipage's since the row's last compaction plus a decayed share of the earlier ones,
# less a redundancy penalty; SnapKV's from its observation window, the prompt's last queries,
# and every query after them, pooled along the slots).
COMPACTION_POLICIES = ("streaming_llm", "key_norm", "h2o", "zipage", "snapkv")
ATTENTION_POLICIES = ("h2o", "zipage", "snapkv")
# Policies whose prompt is prefilled whole and compacted once after it, from the attention its
# last queries (the question, in a question-answering prompt) give each token, as SnapKV does.
WINDOW_POLICIES = ("snapkv",)
MAX_COMPACTIONS = 4  # rows compacted per step; a row needing one more waits a step
COMPACTION_ROWS = (1, MAX_COMPACTIONS)  # the compaction's shapes: one row (the usual case), or all
ZIPAGE_DECAY = 0.8  # a kept slot's score is multiplied by this at each compaction (Zipage's decay_factor)
REDUNDANCY_WEIGHT = 0.2  # Zipage's redudancy_lambda
REDUNDANCY_TEMPERATURE = 0.4  # Zipage's redudancy_temperature


@dataclasses.dataclass(frozen=True)
class PageBudget:
    """At most ``max_pages`` pages of ``page_size`` tokens per request in the full-attention
    pool; a compaction keeps ``keep_slots`` tokens, ranked by ``policy``. A ``WINDOW_POLICIES``
    policy lets a prompt longer than the budget be prefilled whole first (up to
    ``max_model_len``, the engine's: the pages a compaction may read, ``source_pages``)."""

    max_pages: int
    page_size: int
    policy: str = "streaming_llm"
    max_model_len: int | None = None

    def __post_init__(self):
        if isinstance(self.max_pages, bool) or not isinstance(self.max_pages, int) or self.max_pages < 2:
            raise ValueError(
                f"max_pages_per_request must be an int of at least 2 (a compaction keeps max_pages_per_request - 1 "
                f"pages and writes on in the last), got {self.max_pages!r}"
            )
        if self.policy == "pyramidkv":
            raise ValueError(
                "compaction_policy 'pyramidkv' gives each layer its own budget, but a pool's layers share one block "
                "table (one choice of tokens for every layer): use 'snapkv', its scores at one budget"
            )
        if self.policy not in COMPACTION_POLICIES:
            raise ValueError(
                f"compaction_policy must be one of {COMPACTION_POLICIES} (the policies scored from the pages alone), "
                f"got {self.policy!r}"
            )
        try:
            self.spec.check_budget(self.keep_slots)
        except ValueError as error:
            raise ValueError(f"max_pages_per_request={self.max_pages}: {error}") from None

    @property
    def keep_slots(self) -> int:
        """Tokens a compaction keeps: ``max_pages - 1`` full pages."""
        return (self.max_pages - 1) * self.page_size

    @property
    def limit(self) -> int:
        """Slots a request may hold: ``max_pages`` pages."""
        return self.max_pages * self.page_size

    @property
    def prefills_whole(self) -> bool:
        """Is a prompt longer than the budget prefilled whole, then compacted once (SnapKV), rather
        than compacted chunk by chunk as it is prefilled?"""
        return self.policy in WINDOW_POLICIES

    @property
    def source_pages(self) -> int:
        """The most pages a compaction reads from one row (``max_pages``, or the pages of a
        ``max_model_len`` prompt when prompts are prefilled whole)."""
        if not self.prefills_whole:
            return self.max_pages
        if self.max_model_len is None:
            raise ValueError(
                f"PageBudget: compaction_policy {self.policy!r} prefills prompts whole: give max_model_len"
            )
        return max(self.max_pages, -(-self.max_model_len // self.page_size))

    def limit_for(self, prompt_length: int, compacted: bool) -> int:
        """Slots a sequence with a prompt of ``prompt_length`` tokens may hold before its next
        compaction: ``limit``, or its whole prompt until it is first compacted (``prefills_whole``)."""
        if self.prefills_whole and not compacted:
            return max(self.limit, prompt_length)
        return self.limit

    def score_weights(self, positions: np.ndarray, prompt_lengths: np.ndarray) -> np.ndarray | None:
        """``[N]`` float32 what each packed token's attention adds to the slots it reads
        (``PackedBatch.score_weights``) at ``positions`` ``[N]`` (negative: padding) of sequences
        with ``prompt_lengths`` ``[N]``: for SnapKV ``1 / window`` from the prompt's last ``window``
        tokens on (its observation window's mean attention, then each later query's share) and 0
        before them; None (the layer's default, 1 per real token) for the other policies."""
        if not self.prefills_whole:
            return None
        window = self.spec.observation_window
        observing = (positions >= 0) & (positions >= prompt_lengths - window)
        return observing.astype(np.float32) / window

    @property
    def spec(self) -> EvictionSpec:
        """The ``EvictionSpec`` whose ranking a compaction applies (its sinks and window defaults);
        Zipage's: H2O's ranking of its scores with no sinks and the last page always kept (the
        tokens written since the row's last compaction, which few queries have seen)."""
        if self.policy == "zipage":
            return EvictionSpec("h2o", budget=self.keep_slots, window=self.page_size, sinks=0)
        return EvictionSpec(self.policy, budget=self.keep_slots)

    @property
    def scored(self) -> bool:
        """Does the policy rank by the attention slots received (``Paging.scored``)?"""
        return self.policy in ATTENTION_POLICIES

    @property
    def score_decay(self) -> float:
        """What a kept slot's score is multiplied by at a compaction."""
        return ZIPAGE_DECAY if self.policy == "zipage" else 1.0


@dataclasses.dataclass(frozen=True)
class Compaction:
    """One row's compaction, planned by the KV manager: its pages before (``sources``) and after
    (``destinations``), the position each source slot holds (``positions``, -1 past its filled
    slots) and the tokens it has computed (``length``)."""

    owner: Hashable
    sources: list[int]
    destinations: list[int]
    positions: np.ndarray
    length: int


def compaction_inputs(
    compactions: list[Compaction], budget: PageBudget, rows: int | None = None
) -> tuple[np.ndarray, ...]:  # fmt: skip
    """``compact_pages``' inputs for ``compactions``, padded to ``rows`` (default: the smallest of
    ``COMPACTION_ROWS`` that holds them): sources ``[M, S]`` (``S = budget.source_pages``) and
    destinations ``[M, max_pages - 1]`` (the null page as padding), source positions
    ``[M, S * page_size]`` (-1: empty) and lengths ``[M]``."""
    if len(compactions) > MAX_COMPACTIONS:
        raise ValueError(f"{len(compactions)} compactions in one step; at most {MAX_COMPACTIONS}")
    rows = rows or next(size for size in COMPACTION_ROWS if size >= len(compactions))
    sources = np.full((rows, budget.source_pages), NULL_PAGE, np.int32)
    destinations = np.full((rows, budget.max_pages - 1), NULL_PAGE, np.int32)
    positions = np.full((rows, budget.source_pages * budget.page_size), -1, np.int32)
    lengths = np.zeros(rows, np.int32)
    for row, compaction in enumerate(compactions):
        sources[row, : len(compaction.sources)] = compaction.sources
        destinations[row] = compaction.destinations
        positions[row, : len(compaction.positions)] = compaction.positions
        lengths[row] = compaction.length
    return sources, destinations, positions, lengths


def _full_groups(cache: Cache) -> list[int]:
    """Indices of the cache's groups paged in the full-attention pool."""
    return [index for index, group in enumerate(cache.groups) if has(group, PagedStorage) and group.pool == FULL_POOL]


def _scores(
    cache: Cache, budget: PageBudget, sources: jax.Array, positions: jax.Array, lengths: jax.Array
) -> jax.Array:
    """``[M, S * page_size]`` float32 score of each source slot (higher is kept), averaged over
    every layer and K/V head of the pool: its position (StreamingLLM), its key's ``-||k||``, the
    attention it received (H2O; SnapKV's window scores of it), or that as a share of the
    row's total less ``REDUNDANCY_WEIGHT`` times its redundancy (Zipage)."""
    if budget.policy == "streaming_llm":
        return positions.astype(jnp.float32)
    groups = [cache.groups[index] for index in _full_groups(cache)]
    if budget.policy == "key_norm":
        return -_pool_mean([jnp.linalg.norm(group.page_keys(sources), axis=-1) for group in groups], positions)
    filled = positions >= 0
    attention = jnp.where(filled, _pool_mean([group.page_scores(sources) for group in groups], positions), 0.0)
    if budget.policy == "h2o":
        return attention
    if budget.policy == "snapkv":  # the window's own slots unscored (kept), then pooled, as EvictingLayer's prefill
        spec, rescored = budget.spec, jnp.ones(lengths.shape, bool)
        pooled = window_scores(
            attention[:, None], positions[:, None], lengths, spec.observation_window, rescored, spec.kernel_size, 1
        )  # fmt: skip
        return pooled[:, 0]
    share = attention / jnp.maximum(jnp.sum(attention, axis=1, keepdims=True), 1e-30)
    redundancy = _pool_mean([_redundancy(group.page_keys(sources), filled) for group in groups], positions)
    return share - REDUNDANCY_WEIGHT * redundancy


def _pool_mean(per_group: list[jax.Array], positions: jax.Array) -> jax.Array:
    """``[M, S * page_size]``: the mean over layers and K/V heads of per-group ``[L, M, S, page_size, H_kv]``."""
    total = sum(jnp.sum(found, axis=(0, 4)) for found in per_group)  # [M, S, page_size]
    count = sum(found.shape[0] * found.shape[4] for found in per_group)
    return (total / count).reshape(positions.shape)


def _redundancy(keys: jax.Array, filled: jax.Array) -> jax.Array:
    """Zipage's redundancy of each key ``[L, M, S, page_size, H_kv, D]`` among its row's filled
    slots ``[M, S * page_size]``: a softmax over the slots of its summed cosine similarity to
    the others, divided by ``REDUNDANCY_TEMPERATURE`` times the slots filled. Returns
    ``[L, M, S, page_size, H_kv]`` (0 at empty slots). The sum over the others is the unit key's
    dot product with the sum of all unit keys, less its own square: O(slots), not O(slots^2)."""
    layers, rows, pages, size, heads, dim = keys.shape
    flat = keys.reshape(layers, rows, pages * size, heads, dim)
    unit = flat / jnp.maximum(jnp.linalg.norm(flat, axis=-1, keepdims=True), 1e-30)
    unit = jnp.where(filled[None, :, :, None, None], unit, 0.0)
    summed = jnp.einsum("lmshd,lmhd->lmsh", unit, jnp.sum(unit, axis=2)) - jnp.sum(unit * unit, axis=-1)
    count = jnp.sum(filled, axis=1)[None, :, None, None]
    logits = jnp.where(filled[None, :, :, None], summed / (REDUNDANCY_TEMPERATURE * jnp.maximum(count, 1)), -jnp.inf)
    redundancy = jnp.where(filled[None, :, :, None], jax.nn.softmax(logits, axis=2), 0.0)  # [L, M, S', H]
    return redundancy.reshape(layers, rows, pages, size, heads)


def _compact(
    cache: Cache, sources: jax.Array, destinations: jax.Array, positions: jax.Array, lengths: jax.Array,
    budget: PageBudget,
) -> tuple[Cache, jax.Array]:  # fmt: skip
    """The cache with each row's kept tokens copied, in position order, into its destination
    pages (every leaf of every full-pool group: K and V, or their codes and scales, and slot
    scores, multiplied by ``budget.score_decay``), and the positions kept ``[M, keep]`` (-1
    where a padding row keeps nothing). Every slot is read before any is written, so a
    destination may be one of the sources."""
    rows, num_slots = positions.shape
    page_size = num_slots // sources.shape[1]
    keep, spec = destinations.shape[1] * page_size, budget.spec
    scores = _scores(cache, budget, sources, positions, lengths)
    kept_budget = jnp.full((rows,), keep, jnp.int32)
    order, held = kept_order(
        spec, spec.window_for(keep), positions[:, None], scores[:, None], lengths, kept_budget, keep
    )  # fmt: skip
    order, held = order[:, 0] % num_slots, held[:, 0]  # [M, keep]
    slots = jnp.arange(keep)
    moved_from = (jnp.take_along_axis(sources, order // page_size, axis=1), order % page_size)
    moved_to = (
        jnp.where(held, destinations[:, slots // page_size], NULL_PAGE), jnp.broadcast_to(slots % page_size, (rows, keep))
    )  # fmt: skip
    for index in _full_groups(cache):
        cache = cache.with_group(index, cache.groups[index].with_slots_moved(moved_from, moved_to, budget.score_decay))
    return cache, jnp.where(held, jnp.take_along_axis(positions, order, axis=1), -1)


compact_pages = jax.jit(_compact, static_argnames=("budget",), donate_argnums=0)
"""``_compact`` compiled once per engine and row count of ``COMPACTION_ROWS`` (``compaction_inputs``)."""
