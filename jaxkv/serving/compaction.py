"""Compressed pages (Zipage, arXiv 2603.08743): token eviction inside the engine's pages.

With ``max_pages_per_request`` (``PageBudget``) a request holds at most that many pages of the
full-attention pool. When its next tokens would need one more, the KV manager plans a
compaction (``Compaction``): every token the request holds is scored by a policy, the best
``keep_slots`` (``(max_pages - 1) * page_size``: sinks and the recent window always, as
``EvictingLayer`` keeps them, ``jaxkv.layers.evicting.kept_order``) are copied, in position order,
into ``max_pages - 1`` pages, and its other pages go back to the pool. One compiled function
(``compact_pages``) compacts up to ``MAX_COMPACTIONS`` rows between two steps (padded to one of
``COMPACTION_ROWS``); a row beyond that waits a step. The kept keys keep the positions RoPE gave
them; the pool keeps the position each slot holds (``PagedLayer.slot_positions``). The choice
(``PageBudget.choice``) is one for every layer and K/V head of the pool ('pool': the mean of
their scores) or each layer's and K/V head's own ('head': ``EvictingLayer``'s and Zipage's; a
layer may keep fewer, PyramidKV's schedule, the rest of its slots left empty).

Pages others may read are never written: the destinations are the request's own pages that no
other request holds, reused in place (those the prefix cache holds only past its prompt: they
leave the cache), else fresh pages; a shared page, or a cached page of the prompt, is only read
(its tokens are copied, it keeps its other owners or its cache entry).

The KV manager, which owns the pages, asks one ``CompactionPlanner`` per engine where a sequence
stands against its budget: how many tokens it may compute this step (``room``), whether its next
ones take it over (``over``: it compacts first), whether a new sequence fits beside the running
ones' budgets (``holds``); the planner keeps each compacted sequence's shift and hands the
compactions the KV manager plans (``plan``) to the next step (``take``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.batch import PagedStorage
from jaxkv.cache import Cache
from jaxkv.eviction import EvictionSpec, window_scores
from jaxkv.layers.evicting import kept_order
from jaxkv.layers.paged import FULL_POOL, NULL_PAGE
from jaxkv.protocol import has
from jaxkv.serving.requests import SequenceState

# Policies a compaction ranks by: the position, the key, or the attention each slot received
# (``PagedLayer.slot_scores``, kept by the step: H2O's sum over every query since the token was
# written; Zipage's since the row's last compaction plus a decayed share of the earlier ones,
# less a redundancy penalty; SnapKV's from its observation window, the prompt's last queries,
# and every query after them, pooled along the slots).
COMPACTION_POLICIES = ("streaming_llm", "key_norm", "h2o", "zipage", "snapkv", "pyramidkv")
ATTENTION_POLICIES = ("h2o", "zipage", "snapkv", "pyramidkv")
# Policies whose prompt is prefilled whole and compacted once after it, from the attention its
# last queries (the question, in a question-answering prompt) give each token, as SnapKV does.
WINDOW_POLICIES = ("snapkv", "pyramidkv")
# Who shares a compaction's choice of tokens: every layer and K/V head of the pool (their mean
# score), or nobody (each layer and K/V head its own, as EvictingLayer and Zipage choose).
COMPACTION_CHOICES = ("pool", "head")
MAX_COMPACTIONS = 4  # rows compacted per step; a row needing one more waits a step
COMPACTION_ROWS = (1, MAX_COMPACTIONS)  # the compaction's shapes: one row (the usual case), or all
ZIPAGE_DECAY = 0.8  # a kept slot's score is multiplied by this at each compaction (Zipage's decay_factor)
REDUNDANCY_WEIGHT = 0.2  # Zipage's redudancy_lambda
REDUNDANCY_TEMPERATURE = 0.4  # Zipage's redudancy_temperature


@dataclasses.dataclass(frozen=True)
class PageBudget:
    """At most ``max_pages`` pages of ``page_size`` tokens per request in the full-attention
    pool; a compaction keeps ``keep_slots`` tokens, ranked by ``policy``, chosen for the whole pool
    or per layer and K/V head (``choice``, one of ``COMPACTION_CHOICES``). A ``WINDOW_POLICIES``
    policy lets a prompt longer than the budget be prefilled whole first (up to
    ``max_model_len``, the engine's: the pages a compaction may read, ``source_pages``)."""

    max_pages: int
    page_size: int
    policy: str = "streaming_llm"
    max_model_len: int | None = None
    choice: str = "pool"

    def __post_init__(self):
        if isinstance(self.max_pages, bool) or not isinstance(self.max_pages, int) or self.max_pages < 2:
            raise ValueError(
                f"max_pages_per_request must be an int of at least 2 (a compaction keeps max_pages_per_request - 1 "
                f"pages and writes on in the last), got {self.max_pages!r}"
            )
        self.check_options(self.policy, self.choice)
        try:
            self.spec.check_budget(self.keep_slots)
        except ValueError as error:
            raise ValueError(f"max_pages_per_request={self.max_pages}: {error}") from None

    @staticmethod
    def check_options(policy: str, choice: str) -> None:
        """``policy`` is a compaction policy and ``choice`` a compaction choice that it takes."""
        if choice not in COMPACTION_CHOICES:
            raise ValueError(f"compaction_choice must be one of {COMPACTION_CHOICES}, got {choice!r}")
        if policy not in COMPACTION_POLICIES:
            raise ValueError(
                f"compaction_policy must be one of {COMPACTION_POLICIES} (the policies scored from the pages alone), "
                f"got {policy!r}"
            )
        if policy == "pyramidkv" and choice != "head":
            raise ValueError(
                "compaction_policy 'pyramidkv' gives each layer its own budget: it needs compaction_choice='head' "
                "(each layer and K/V head its own tokens), got 'pool'"
            )

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
        tokens written since the row's last compaction, which few queries have seen); PyramidKV's
        ranks as SnapKV's (its layers' budgets: ``layer_spec``)."""
        if self.policy == "zipage":
            return EvictionSpec("h2o", budget=self.keep_slots, window=self.page_size, sinks=0)
        return EvictionSpec(self.policy, budget=self.keep_slots)

    def layer_spec(self, num_layers: int) -> EvictionSpec:
        """The ``EvictionSpec`` an ``EvictingLayer`` keeping per layer and K/V head what a 'head'
        compaction keeps takes, for a model of ``num_layers`` layers: ``spec``; PyramidKV's at the
        largest mean budget whose first (largest) layer's fits ``keep_slots`` (no prompt-length cap;
        where its schedule falls back to one budget, that budget in every layer)."""
        spec = self.spec
        if self.policy != "pyramidkv":
            return spec
        means = (dataclasses.replace(spec, budget=mean) for mean in range(self.keep_slots, 0, -1))
        return next(mean for mean in means if max(mean.layer_budgets(num_layers)) <= self.keep_slots)

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
    (``destinations``), the slots of the sources it has written (``filled``: the others hold
    nothing) and the tokens it has computed (``length``)."""

    owner: Hashable
    sources: list[int]
    destinations: list[int]
    filled: int
    length: int


class CompactionPlanner:
    """The page budgets of one engine's sequences (``budget``; None: unbounded) and the compactions
    that keep them, for the KV manager, which owns the pages and asks here (the module docstring):
    each compacted sequence's ``shift`` (its full-pool slot s past its last compaction holds
    position s + shift; the pool keeps the positions of the slots before,
    ``PagedLayer.slot_positions``), the compactions planned for the next step (``take``) and the
    arithmetic of limits and room. ``prefix_caching``: the KV manager's (a compaction copies a
    cached prompt page rather than overwrite it)."""

    def __init__(self, budget: PageBudget | None, prefix_caching: bool):
        self.budget = budget
        self.prefix_caching = prefix_caching
        self.compacted: dict[Hashable, int] = {}  # each compacted sequence's shift, by key
        self.num_compactions = 0  # planned since start
        self._planned: list[Compaction] = []  # for the next step

    def shift(self, key: Hashable) -> int:
        """How far the positions of the sequence ``key``'s new tokens run ahead of its full-pool slots."""
        return self.compacted.get(key, 0)

    def over(self, seq: SequenceState, end: int) -> bool:
        """Would holding ``seq``'s tokens up to position ``end`` take it past its budget (it compacts first)?"""
        return self.budget is not None and end - self.shift(seq.key) > self._limit(seq)

    def room(self, seq: SequenceState, count: int, admitted_at: int | None = None, resumes: bool = False) -> int:
        """How many of ``count`` next tokens ``seq`` may compute this step (``KVCacheManager.room``):
        running (``admitted_at`` None) or being admitted on a hit of ``admitted_at`` tokens (``resumes``:
        a swapped-out sequence's own pages). Up to its budget; at its budget a running sequence
        compacts first (a chunk then fits the page the compaction leaves), or waits (0) when the
        step's compactions are used up; a sequence resumed at its budget takes its pages back with
        no tokens (0): running, it compacts in the next step."""
        if self.budget is None:
            return count
        running = admitted_at is None
        slots = (seq.num_computed if running else admitted_at) - (self.shift(seq.key) if running or resumes else 0)
        limit = self._limit(seq)
        if slots < limit:
            return min(count, limit - slots)
        if not running or len(self._planned) >= MAX_COMPACTIONS:
            return 0
        return min(count, self.budget.limit - self.budget.keep_slots)

    def admitted_pages(self, seq: SequenceState, num_pages: int) -> int:
        """Of ``num_pages`` cached pages of ``seq``'s prompt, how many it may be admitted on: all
        of them, or under a budget those below it (compactions are the running sequences')."""
        if self.budget is None:
            return num_pages
        return min(num_pages, (self._limit(seq) - 1) // self.budget.page_size)

    def holds(self, running: Sequence[SequenceState], seq: SequenceState, full_pages: int) -> bool:
        """May ``seq`` join the ``running`` sequences in a full pool of ``full_pages`` usable pages
        (``KVCacheManager.holds_budgets``)? Under a budget only while the pool holds the most pages
        each of them may come to hold; always without one, and always into an empty engine."""
        if self.budget is None or not running:
            return True
        return sum(self._most_pages(other) for other in [*running, seq]) <= full_pages

    def fit_pages(self, num_prompt: int, pages: int) -> int:
        """The full-pool pages a sequence of a ``num_prompt``-token prompt needing ``pages`` holds at
        once (``KVCacheManager.check_fits``): under a budget its most, and the fresh pages it
        compacts into."""
        if self.budget is None:
            return pages
        held = -(-self.budget.limit_for(num_prompt, compacted=False) // self.budget.page_size)
        return min(pages, held + self.budget.max_pages)

    def table_length(self, max_model_len: int) -> int:
        """Tokens a full-pool block-table row covers: ``max_model_len``, or under a budget at most
        what a compaction reads."""
        if self.budget is None:
            return max_model_len
        return min(max_model_len, self.budget.source_pages * self.budget.page_size)

    def prompt_pages(self, seq: SequenceState) -> int:
        """Full pages of ``seq``'s prompt: a compaction copies them when cached (they stay in the
        prefix cache) and overwrites its later pages in place."""
        return len(seq.prompt) // self.budget.page_size

    def extra_pages(self, num_new_tokens: int) -> int:
        """Pages past the kept ``max_pages - 1`` that a compacted sequence's next ``num_new_tokens`` take."""
        return -(-(self.budget.keep_slots + num_new_tokens) // self.budget.page_size) - (self.budget.max_pages - 1)

    def plan(self, seq: SequenceState, sources: list[int], destinations: list[int]) -> None:
        """Plan ``seq``'s compaction from its full-pool pages ``sources`` into ``destinations``
        (made by the next step); its shift then counts the tokens it dropped."""
        filled = seq.num_computed - self.shift(seq.key)
        self._planned.append(Compaction(seq.key, sources, destinations, filled, seq.num_computed))
        self.num_compactions += 1
        self.compacted[seq.key] = seq.num_computed - self.budget.keep_slots

    def compacting(self, key: Hashable) -> bool:
        """Is the sequence ``key`` compacted in the next step (its pages are read before the step's
        compactions are made)?"""
        return any(compaction.owner == key for compaction in self._planned)

    def take(self) -> list[Compaction]:
        """The compactions planned since the last call."""
        planned, self._planned = self._planned, []
        return planned

    def forget(self, key: Hashable) -> None:
        """The sequence ``key`` is computed again from its start, or freed: no compaction holds."""
        self.compacted.pop(key, None)

    def check(self, pages: dict[Hashable, list[int]], page_hash: Callable[[int], bytes | None]) -> None:
        """Raise ``AssertionError`` unless every owner of full-pool ``pages`` is within its budget (a
        compacted one) or what a compaction reads (a prompt prefilled whole), and no compacted
        owner's page is registered in the prefix cache (``page_hash``: a page's hash there, or
        None). No-op without a budget."""
        if self.budget is None:
            return
        most = {
            owner: self.budget.max_pages if owner in self.compacted else self.budget.source_pages for owner in pages
        }
        over = [owner for owner, held in pages.items() if len(held) > most[owner]]
        if over:
            raise AssertionError(
                f"owners {over} hold more pages than their budget (max_pages_per_request={self.budget.max_pages})"
            )
        cached = [owner for owner in self.compacted if any(page_hash(page) for page in pages.get(owner, ()))]
        if cached:
            raise AssertionError(f"compacted owners {cached} hold pages registered in the prefix cache")

    def _limit(self, seq: SequenceState) -> int:
        """Full-pool slots ``seq`` may hold before its next compaction (``PageBudget.limit_for``)."""
        return self.budget.limit_for(len(seq.prompt), seq.key in self.compacted)

    def _most_pages(self, seq: SequenceState) -> int:
        """Full-pool pages ``seq`` may come to hold: its limit, or all its tokens when its prompt
        and ``max_tokens`` take fewer; before its first compaction, with the fresh pages that
        compaction takes for its cached prompt pages."""
        length = len(seq.prompt) + seq.options.max_tokens
        slots = min(self._limit(seq), length)
        pages = -(-slots // self.budget.page_size)
        if slots < length and self.prefix_caching and seq.key not in self.compacted:
            pages += min(self.prompt_pages(seq), self.budget.max_pages - 1)
        return pages


def compaction_inputs(
    compactions: list[Compaction], budget: PageBudget, rows: int | None = None
) -> tuple[np.ndarray, ...]:  # fmt: skip
    """``compact_pages``' inputs for ``compactions``, padded to ``rows`` (default: the smallest of
    ``COMPACTION_ROWS`` that holds them): sources ``[M, S]`` (``S = budget.source_pages``) and
    destinations ``[M, max_pages - 1]`` (the null page as padding), filled slots ``[M]`` and
    lengths ``[M]`` (0 for padding)."""
    if len(compactions) > MAX_COMPACTIONS:
        raise ValueError(f"{len(compactions)} compactions in one step; at most {MAX_COMPACTIONS}")
    rows = rows or next(size for size in COMPACTION_ROWS if size >= len(compactions))
    sources = np.full((rows, budget.source_pages), NULL_PAGE, np.int32)
    destinations = np.full((rows, budget.max_pages - 1), NULL_PAGE, np.int32)
    filled, lengths = np.zeros(rows, np.int32), np.zeros(rows, np.int32)
    for row, compaction in enumerate(compactions):
        sources[row, : len(compaction.sources)] = compaction.sources
        destinations[row] = compaction.destinations
        filled[row], lengths[row] = compaction.filled, compaction.length
    return sources, destinations, filled, lengths


def _full_groups(cache: Cache) -> list[int]:
    """Indices of the cache's groups paged in the full-attention pool."""
    return [index for index, group in enumerate(cache.groups) if has(group, PagedStorage) and group.pool == FULL_POOL]


def _slots(found: jax.Array) -> jax.Array:
    """``[L, M, S, page_size, H_kv, ...]`` per page -> ``[L, M, S * page_size, H_kv, ...]`` per row slot."""
    return found.reshape(found.shape[0], found.shape[1], -1, *found.shape[4:])


def _per_head(x: jax.Array) -> jax.Array:
    """``[L, M, S, H]`` -> ``[L * M, H, S]``: EvictingLayer's ``[B, H_kv, S]``, a row per layer and row."""
    layers, rows, num_slots, heads = x.shape
    return x.transpose(0, 1, 3, 2).reshape(layers * rows, heads, num_slots)


def _per_slot(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``_per_head``'s inverse: ``[L * M, H, S]`` -> ``shape`` ``[L, M, S, H]``."""
    layers, rows, num_slots, heads = shape
    return x.reshape(layers, rows, heads, num_slots).transpose(0, 1, 3, 2)


def _scores(
    group: PagedStorage, budget: PageBudget, sources: jax.Array, positions: jax.Array, lengths: jax.Array
) -> jax.Array:
    """``[L, M, S * page_size, H_kv]`` float32 score of each source slot (higher is kept) in each
    layer and K/V head of ``group``, its slots holding ``positions`` (-1: empty): the position
    (StreamingLLM), the key's ``-||k||``, the attention it received (H2O; SnapKV's and
    PyramidKV's window scores of it), or that as a share of the head's total less
    ``REDUNDANCY_WEIGHT`` times its redundancy (Zipage)."""
    if budget.policy == "streaming_llm":
        return positions.astype(jnp.float32)
    if budget.policy == "key_norm":
        return -jnp.linalg.norm(_slots(group.page_keys(sources)), axis=-1)
    filled = positions >= 0
    attention = jnp.where(filled, _slots(group.page_scores(sources)), 0.0)
    if budget.policy == "h2o":
        return attention
    if budget.prefills_whole:  # the window's own slots unscored (kept), then pooled, as EvictingLayer's prefill
        layers = attention.shape[0]
        spec, rescored = budget.spec, jnp.ones(layers * lengths.shape[0], bool)
        pooled = window_scores(
            _per_head(attention), _per_head(positions), jnp.tile(lengths, layers), spec.observation_window, rescored,
            spec.kernel_size, 1,
        )  # fmt: skip
        return _per_slot(pooled, attention.shape)
    share = attention / jnp.maximum(jnp.sum(attention, axis=2, keepdims=True), 1e-30)
    return share - REDUNDANCY_WEIGHT * _redundancy(_slots(group.page_keys(sources)), filled)


def _redundancy(keys: jax.Array, filled: jax.Array) -> jax.Array:
    """Zipage's redundancy of each key ``[L, M, S, H_kv, D]`` among its head's filled slots
    ``[L, M, S, H_kv]``: a softmax over the slots of its summed cosine similarity to the others,
    divided by ``REDUNDANCY_TEMPERATURE`` times the slots filled. Returns ``[L, M, S, H_kv]`` (0 at
    empty slots). The sum over the others is the unit key's dot product with the sum of all unit
    keys, less its own square: O(slots), not O(slots^2)."""
    unit = keys / jnp.maximum(jnp.linalg.norm(keys, axis=-1, keepdims=True), 1e-30)
    unit = jnp.where(filled[..., None], unit, 0.0)
    summed = jnp.einsum("lmshd,lmhd->lmsh", unit, jnp.sum(unit, axis=2)) - jnp.sum(unit * unit, axis=-1)
    count = jnp.sum(filled, axis=2, keepdims=True)
    logits = jnp.where(filled, summed / (REDUNDANCY_TEMPERATURE * jnp.maximum(count, 1)), -jnp.inf)
    return jnp.where(filled, jax.nn.softmax(logits, axis=2), 0.0)


def _kept(
    budget: PageBudget, positions: jax.Array, scores: jax.Array, lengths: jax.Array, budgets: jax.Array, keep: int
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """``kept_order`` for candidates ``[L, M, S, H]`` (positions, scores) of rows of ``lengths``
    ``[M]``, layer l keeping ``budgets[l]`` of ``keep`` slots: the candidate indices in position
    order ``[L, M, keep, H]`` (modulo ``S``) and whether each is kept."""
    layers, rows, num_slots, heads = positions.shape
    spec = budget.spec
    order, held = kept_order(
        spec, spec.window_for(keep), _per_head(positions), _per_head(scores), jnp.tile(lengths, layers),
        jnp.repeat(budgets, rows), keep,
    )  # fmt: skip
    return _per_slot(order % num_slots, (layers, rows, keep, heads)), _per_slot(held, (layers, rows, keep, heads))


def _choices(
    cache: Cache, budget: PageBudget, sources: jax.Array, filled: jax.Array, lengths: jax.Array, keep: int
) -> list[tuple[jax.Array, jax.Array]]:  # fmt: skip
    """Per full-pool group, the source slots each layer and K/V head keeps (``_kept``: ``[L, M,
    keep, H_kv]``, or ``[1, M, keep, 1]`` for a choice shared by the pool, the mean of every layer's
    and K/V head's scores). Slots at or past ``filled`` ``[M]`` hold nothing."""
    groups = [cache.groups[index] for index in _full_groups(cache)]
    written = jnp.arange(sources.shape[1] * budget.page_size)[None, :] < filled[:, None]  # [M, S * page_size]
    positions = [jnp.where(written[None, :, :, None], _slots(group.page_positions(sources)), -1) for group in groups]
    scores = [_scores(group, budget, sources, held, lengths) for group, held in zip(groups, positions, strict=True)]
    if budget.choice == "pool":
        total = sum(jnp.sum(found, axis=(0, 3)) for found in scores)
        mean = total / sum(found.shape[0] * found.shape[3] for found in scores)
        choice = _kept(budget, positions[0][:1, :, :, :1], mean[None, :, :, None], lengths, jnp.full(1, keep), keep)
        return [choice] * len(groups)
    layers = cache.layer_types
    slots = budget.layer_spec(len(layers)).layer_budgets(len(layers))
    return [
        _kept(budget, held, found, lengths, jnp.asarray([slots[layer] for layer in cache.group_layers(index)]), keep)
        for index, held, found in zip(_full_groups(cache), positions, scores, strict=True)
    ]


def _compact(
    cache: Cache, sources: jax.Array, destinations: jax.Array, filled: jax.Array, lengths: jax.Array,
    budget: PageBudget,
) -> Cache:  # fmt: skip
    """The cache with each row's kept tokens copied, in position order, into its destination
    pages, per layer and K/V head (every leaf of every full-pool group: K and V, or their codes
    and scales, slot positions, and slot scores multiplied by ``budget.score_decay``); a slot a
    layer's smaller budget leaves empty holds position -1. Every slot is read before any is
    written, so a destination may be one of the sources."""
    rows, page_size = sources.shape[0], budget.page_size
    keep = destinations.shape[1] * page_size
    slots = jnp.arange(keep)
    moved_to = (destinations[:, slots // page_size], jnp.broadcast_to(slots % page_size, (rows, keep)))
    for index, (order, held) in zip(_full_groups(cache), _choices(cache, budget, sources, filled, lengths, keep)):
        moved_from = (sources[jnp.arange(rows)[None, :, None, None], order // page_size], order % page_size)
        group = cache.groups[index].with_slots_moved(moved_from, moved_to, held, budget.score_decay)
        cache = cache.with_group(index, group)
    return cache


compact_pages = jax.jit(_compact, static_argnames=("budget",), donate_argnums=0)
"""``_compact`` compiled once per engine and row count of ``COMPACTION_ROWS`` (``compaction_inputs``)."""
