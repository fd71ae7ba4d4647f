"""Compressed pages (Zipage, arXiv 2603.08743): token eviction inside the engine's pages.

With ``max_pages_per_request`` (``PageBudget``) a request holds at most that many pages of the
full-attention pool. When its next tokens would need one more, the KV manager plans a
compaction (``Compaction``): every token the request holds is scored by a policy, the best
``keep_slots`` (``(max_pages - 1) * page_size``: sinks and the recent window always, as
``EvictingLayer`` keeps them, ``jaxkv.layers.evicting.kept_order``) are copied, in position order,
into ``max_pages - 1`` pages, and its other pages go back to the pool. One compiled function
(``compact_pages``) compacts up to ``MAX_COMPACTIONS`` rows between two steps; a row beyond that
waits a step. The kept keys keep the positions RoPE gave them; the row's slots now hold
non-contiguous positions, which the host keeps (``KVCacheManager.row_positions``) and the step
masks by. One choice of tokens holds for every layer and K/V head of the pool (one block table).

Pages others may read are never written: the destinations are the request's own pages that no
other request and no prefix-cache entry holds, reused in place, else fresh pages; a shared or
cached page is only read (its tokens are copied, it keeps its other owners or its cache entry).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.batch import PagedStorage
from jaxkv.cache import Cache
from jaxkv.eviction import EvictionSpec
from jaxkv.layers.evicting import kept_order
from jaxkv.layers.paged import FULL_POOL, NULL_PAGE
from jaxkv.protocol import has

# Policies a compaction scores by: those that need no state beyond the pages (the position, the key).
COMPACTION_POLICIES = ("streaming_llm", "key_norm")
MAX_COMPACTIONS = 4  # rows compacted between two steps; a row needing one more waits a step


@dataclasses.dataclass(frozen=True)
class PageBudget:
    """At most ``max_pages`` pages of ``page_size`` tokens per request in the full-attention
    pool; a compaction keeps ``keep_slots`` tokens, ranked by ``policy``."""

    max_pages: int
    page_size: int
    policy: str = "streaming_llm"

    def __post_init__(self):
        if isinstance(self.max_pages, bool) or not isinstance(self.max_pages, int) or self.max_pages < 2:
            raise ValueError(
                f"max_pages_per_request must be an int of at least 2 (a compaction keeps max_pages_per_request - 1 "
                f"pages and writes on in the last), got {self.max_pages!r}"
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
    def spec(self) -> EvictionSpec:
        """The ``EvictionSpec`` whose ranking a compaction applies (its sinks and window defaults)."""
        return EvictionSpec(self.policy, budget=self.keep_slots)


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


def compaction_inputs(compactions: list[Compaction], budget: PageBudget) -> tuple[np.ndarray, ...]:
    """``compact_pages``' inputs for ``compactions``, padded to ``MAX_COMPACTIONS`` rows: sources
    ``[M, max_pages]`` and destinations ``[M, max_pages - 1]`` (the null page as padding),
    source positions ``[M, max_pages * page_size]`` (-1: empty) and lengths ``[M]``."""
    if len(compactions) > MAX_COMPACTIONS:
        raise ValueError(f"{len(compactions)} compactions in one step; at most {MAX_COMPACTIONS}")
    rows = MAX_COMPACTIONS
    sources = np.full((rows, budget.max_pages), NULL_PAGE, np.int32)
    destinations = np.full((rows, budget.max_pages - 1), NULL_PAGE, np.int32)
    positions = np.full((rows, budget.limit), -1, np.int32)
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


def _scores(cache: Cache, policy: str, sources: jax.Array, positions: jax.Array) -> jax.Array:
    """``[M, S * page_size]`` float32 score of each source slot (higher is kept): its position
    (StreamingLLM), or its key's ``-||k||`` averaged over every layer and K/V head of the pool."""
    if policy == "streaming_llm":
        return positions.astype(jnp.float32)
    norms = [jnp.linalg.norm(cache.groups[index].page_keys(sources), axis=-1) for index in _full_groups(cache)]
    total = sum(jnp.sum(norm, axis=(0, 4)) for norm in norms)  # [M, S, page_size]
    count = sum(norm.shape[0] * norm.shape[4] for norm in norms)
    return -(total / count).reshape(positions.shape)


def _compact(
    cache: Cache, sources: jax.Array, destinations: jax.Array, positions: jax.Array, lengths: jax.Array,
    spec: EvictionSpec,
) -> tuple[Cache, jax.Array]:  # fmt: skip
    """The cache with each row's kept tokens copied, in position order, into its destination
    pages (every leaf of every full-pool group: K and V, or their codes and scales), and the
    positions kept ``[M, keep]`` (-1 where a padding row keeps nothing). Every slot is read
    before any is written, so a destination may be one of the sources."""
    rows, num_slots = positions.shape
    page_size = num_slots // sources.shape[1]
    keep = destinations.shape[1] * page_size
    scores = _scores(cache, spec.policy, sources, positions)
    budget = jnp.full((rows,), keep, jnp.int32)
    order, held = kept_order(
        spec, spec.window_for(keep), positions[:, None], scores[:, None], lengths, budget, keep
    )  # fmt: skip
    order, held = order[:, 0] % num_slots, held[:, 0]  # [M, keep]
    source_page = jnp.take_along_axis(sources, order // page_size, axis=1)
    slots = jnp.arange(keep)
    destination_page = jnp.where(held, destinations[:, slots // page_size], NULL_PAGE)
    destination_offset = jnp.broadcast_to(slots % page_size, (rows, keep))

    def moved(leaf: jax.Array) -> jax.Array:  # [L, P, page_size, ...]
        return leaf.at[:, destination_page, destination_offset].set(leaf[:, source_page, order % page_size])

    for index in _full_groups(cache):
        cache = cache.with_group(index, jax.tree.map(moved, cache.groups[index]))
    return cache, jnp.where(held, jnp.take_along_axis(positions, order, axis=1), -1)


compact_pages = jax.jit(_compact, static_argnames=("spec",), donate_argnums=0)
"""``_compact`` compiled once per engine (its inputs are padded to ``MAX_COMPACTIONS`` rows)."""
