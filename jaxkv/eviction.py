"""K/V eviction policies: ``EvictionSpec`` (which policy, how many slots) and the scores each
policy ranks tokens by. ``jaxkv.layers.evicting.EvictingLayer`` stores the kept K/V and applies them.

An evicting layer holds a fixed number of slots per row, K/V head and layer (the budget). Each
update attends over the kept slots plus the new tokens, then keeps the ``budget`` best of them,
per K/V head: the ``sinks`` first positions and the ``window`` most recent ones always, the rest
by the policy's score. Evicted slots hold position -1, so masks stay derived from positions.

Policies (scores: higher is kept):

* ``streaming_llm``: attention sinks + recent tokens (StreamingLLM); the score is the position,
  so the window is everything the sinks leave.
* ``snapkv``: the attention the last ``window`` queries (the observation window) give each key,
  averaged over those queries, smoothed by an average pool of ``kernel_size`` along the keys and
  averaged over the query heads sharing the K/V head (SnapKV, as kvpress computes it). An update
  that brings a row at least ``window`` tokens (a prefill) rescores every kept token; a shorter one
  (a decode step) scores only its new tokens, from its own queries.
* ``pyramidkv``: SnapKV's scores with per-layer budgets, lower layers keeping more: kvpress's
  ``PyramidKVPress`` schedule (linear in depth, steepness ``beta``, the first layer capped at the
  prompt's length minus its window), planned for a prompt of ``prompt_length`` tokens (the cache's
  ``max_length`` unless given; neither: a prompt longer than any layer's budget, no cap); ``budget``
  is the mean over layers (a ``compression_ratio``: its fraction of the prompt length, unrounded,
  as kvpress's).
* ``h2o``: heavy hitters: each token's attention mass accumulated over every query that has
  seen it (all queries of every update, summed over the query heads of its K/V head) (H2O).
* ``key_norm``: the negative L2 norm of the key (low-norm keys draw attention).

``budget`` counts slots; ``compression_ratio`` r instead keeps ``max(1, int(max_length * (1 - r)))``
(kvpress's count, of the cache's ``max_length``), and r = 0 builds the uncompressed layer:
exactly the full cache's outputs.

A sweep of budgets needs one prefill per policy, not one per budget: prefill with ``observer``
(a budget that holds every token, scored as the policy scores), then ``Cache.evict(spec)`` cuts the
held slots to each budget by the stored scores, which is the cache that prefilling at that budget
in one update gives.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
from pydantic import ConfigDict

POLICIES = ("streaming_llm", "snapkv", "pyramidkv", "h2o", "key_norm")
# Policies whose scores come from attention weights (the layer asks attention for slot mass).
ATTENTION_SCORED = ("snapkv", "pyramidkv", "h2o")
DEFAULT_WINDOW = 64  # SnapKV's observation window (kvpress's default)
# What each policy's stored scores measure; PyramidKV ranks by SnapKV's scores.
SCORES = {
    "streaming_llm": "position", "snapkv": "window attention", "pyramidkv": "window attention",
    "h2o": "accumulated attention", "key_norm": "key norm",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class EvictionSpec:
    """Which policy an ``EvictingLayer`` evicts by and how many slots it keeps; see the module
    docstring and each field's. Give exactly one of ``budget`` and ``compression_ratio``."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # a config key that is no field is an error

    policy: Literal[POLICIES]
    """The policy that ranks the tokens: one of ``POLICIES``."""
    budget: int | None = None
    """Slots per row, K/V head and layer (the mean over layers for ``pyramidkv``)."""
    compression_ratio: float | None = None
    """The fraction of ``max_length`` evicted, in [0, 1) (instead of ``budget``)."""
    window: int | None = None
    """The most recent positions always kept (None: the policy's default: everything after the sinks
    for ``streaming_llm``, 64 for ``snapkv``/``pyramidkv``, half the budget for ``h2o``, 0 for ``key_norm``)."""
    sinks: int | None = None
    """The first positions always kept (None: StreamingLLM's 4, 0 for the others)."""
    kernel_size: int = 5
    """SnapKV's pooling window over the scores (odd)."""
    beta: float = 20.0
    """PyramidKV's steepness (at least 1)."""
    prompt_length: int | None = None
    """PyramidKV's only: the prompt length its schedule is planned for (kvpress's ``q_len``; None: the
    cache's ``max_length``, set by ``resolved``, or with neither no cap)."""

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"EvictionSpec: unknown policy {self.policy!r}; known policies: {list(POLICIES)}")
        if (self.budget is None) == (self.compression_ratio is None):
            raise ValueError(
                "EvictionSpec: give exactly one of budget (slots) and compression_ratio (fraction evicted)"
            )
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"EvictionSpec: budget must be at least 1 slot, got {self.budget}")
        if self.compression_ratio is not None and not 0 <= self.compression_ratio < 1:
            raise ValueError(f"EvictionSpec: compression_ratio must be in [0, 1), got {self.compression_ratio}")
        for name in ("window", "sinks"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"EvictionSpec: {name} must be >= 0, got {getattr(self, name)}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"EvictionSpec: kernel_size must be a positive odd number, got {self.kernel_size}")
        if self.beta < 1:
            raise ValueError(f"EvictionSpec: beta must be >= 1, got {self.beta}")
        if self.prompt_length is not None and self.policy != "pyramidkv":
            raise ValueError(
                f"EvictionSpec: prompt_length plans PyramidKV's per-layer budgets; {self.policy!r} keeps one budget "
                f"in every layer: drop prompt_length"
            )
        if self.prompt_length is not None and self.prompt_length < 1:
            raise ValueError(f"EvictionSpec: prompt_length must be at least 1 token, got {self.prompt_length}")

    @property
    def uses_attention(self) -> bool:
        """Whether the policy scores tokens by the attention they receive."""
        return self.policy in ATTENTION_SCORED

    def is_uncompressed(self) -> bool:
        """A compression ratio of 0: nothing is evicted, the plain layer is built instead."""
        return self.compression_ratio == 0

    def resolved(self, max_length: int | None) -> EvictionSpec:
        """This spec for a cache of ``max_length`` tokens (None: unbounded), holding what its layers'
        budgets need: a ``compression_ratio`` turned into a budget of slots, the fraction kept of
        ``max_length``, at least 1 (kvpress's count); PyramidKV's ``prompt_length`` set to
        ``max_length`` unless given, a ratio kept as it is (kvpress plans its schedule from the
        fraction of the prompt, unrounded)."""
        if self.budget is None and self.prompt_length is None and max_length is None:
            raise ValueError("EvictionSpec: a compression_ratio is a fraction of max_length: pass max_length")
        if self.policy == "pyramidkv":
            if self.prompt_length is not None or max_length is None:
                return self
            return dataclasses.replace(self, prompt_length=max_length)
        if self.budget is not None:
            return self
        budget = max(1, int(max_length * (1 - self.compression_ratio)))
        return dataclasses.replace(self, budget=budget, compression_ratio=None)

    def sink_count(self) -> int:
        return (4 if self.policy == "streaming_llm" else 0) if self.sinks is None else self.sinks

    def window_for(self, budget: int | None) -> int:
        """The recent positions always kept by a layer of ``budget`` slots (None: a PyramidKV spec
        of a compression ratio, whose window does not depend on the budget)."""
        if self.window is not None:
            return self.window
        if self.policy == "streaming_llm":
            return budget - self.sink_count()
        if self.policy == "h2o":
            return budget // 2
        return {"snapkv": DEFAULT_WINDOW, "pyramidkv": DEFAULT_WINDOW, "key_norm": 0}[self.policy]

    def layer_budgets(self, num_layers: int) -> list[int]:
        """Slots of each of ``num_layers`` layers of a ``resolved`` spec: the budget everywhere, except
        PyramidKV's schedule for its ``prompt_length`` (``_pyramid_budgets``; the mean is the budget,
        or the ratio's fraction of the prompt length), whose always-kept positions (sinks, 0 by
        default, and the window) are kvpress's ``window_size``."""
        if self.budget is None and self.prompt_length is None:
            raise ValueError("EvictionSpec.layer_budgets: resolve the compression ratio first (resolved(max_length))")
        if self.policy != "pyramidkv":
            return [self.budget] * num_layers
        length = math.inf if self.prompt_length is None else self.prompt_length
        mean = self.budget if self.budget is not None else length * (1 - self.compression_ratio)
        protected = self.sink_count() + self.observation_window
        return _pyramid_budgets(mean, length, protected, self.beta, num_layers)

    @property
    def observation_window(self) -> int | None:
        """SnapKV's (and PyramidKV's) observation window: the queries its scores come from; None
        for the policies that score otherwise."""
        if SCORES[self.policy] != "window attention":
            return None
        return DEFAULT_WINDOW if self.window is None else self.window

    def scoring(self) -> tuple:
        """What the scores a layer stores under this spec depend on: SnapKV's (and PyramidKV's)
        on the observation window and the pooling kernel, the others on the policy alone. A layer
        can be evicted to any spec of equal scoring (``EvictingLayer.evict_to``)."""
        if self.observation_window is not None:
            return SCORES[self.policy], self.observation_window, self.kernel_size
        return (SCORES[self.policy],)

    def observer(self, slots: int) -> EvictionSpec:
        """A spec keeping ``slots`` slots in every layer and scoring as this one does: prefilled with
        at most ``slots`` tokens it evicts nothing, and ``Cache.evict(self)`` then cuts it to this
        spec's budget. PyramidKV's observer is SnapKV's (same scores, one budget for all layers)."""
        policy = "snapkv" if self.policy == "pyramidkv" else self.policy
        return dataclasses.replace(self, policy=policy, budget=slots, compression_ratio=None, prompt_length=None)

    def check_budget(self, budget: int) -> None:
        """The sinks and the window must leave room in ``budget`` slots (they are always kept)."""
        protected = self.sink_count() + self.window_for(budget)
        if protected > budget:
            raise ValueError(
                f"EvictionSpec({self.policy!r}): {self.sink_count()} sinks + a window of {self.window_for(budget)} "
                f"recent tokens are always kept but the budget is {budget} slots; give a larger budget or a smaller "
                f"window"
            )


def _pyramid_budgets(mean: float, prompt_length: float, window: int, beta: float, num_layers: int) -> list[int]:
    """PyramidKV's slots per layer, kvpress's ``PyramidKVPress.get_layer_budget`` (0.5.5) step for
    step: ``mean`` slots per layer over a prompt of ``prompt_length`` tokens (``math.inf``:
    unknown, no cap), ``window`` positions always kept. Linear in depth from ``2 * mean - mean /
    beta`` at the first layer to ``mean / beta`` at the last; a first layer above ``prompt_length -
    window`` is capped there and the last raised by as much (the mean stays). A schedule that
    cannot fall from its first layer to a last one holding the window (a small mean, or one near
    the prompt's length) is ``mean`` (rounded, at least 1) in every layer; a model of one layer
    keeps the first layer's budget, as kvpress's does."""
    share = (window + mean) - window  # kvpress's max_capacity_prompt - window_size, in its float arithmetic
    low = share / beta
    high = share * 2 - low
    if high >= prompt_length - window:
        high = prompt_length - window
        low = share * 2 - high
    if not prompt_length >= high >= low >= window:
        return [max(1, round(mean))] * num_layers
    step = (high - low) / (num_layers - 1) if num_layers > 1 else 0.0
    return [round(high - layer * step) for layer in range(num_layers)]


def window_query_weights(positions: jax.Array, lengths: jax.Array, window: int) -> jax.Array:
    """``[B, T]``: SnapKV's observation window, each row's queries among its last ``window``
    positions (of ``lengths`` after the update) weighted equally, summing to 1 (0 for a row
    without one); ``positions`` ``[B, T]``, negative for padding."""
    observing = (positions >= 0) & (positions >= (lengths - window)[:, None])
    return observing / jnp.maximum(jnp.sum(observing, axis=1, keepdims=True), 1)


def window_scores(
    mass: jax.Array, positions: jax.Array, lengths: jax.Array, window: int, rescored: jax.Array, kernel_size: int,
    group: int,
) -> jax.Array:  # fmt: skip
    """SnapKV's scores ``[B, H_kv, S]`` of slots at ``positions`` ``[B, H_kv, S]`` from their window
    ``mass`` (``pooled_window_mass``): a row the update ``rescored`` (it brought a whole window)
    leaves the window's own slots unscored, as kvpress does."""
    in_window = positions >= (lengths - window)[:, None, None]
    return pooled_window_mass(jnp.where(rescored[:, None, None] & in_window, 0.0, mass), kernel_size, group)


def pooled_window_mass(mass: jax.Array, kernel_size: int, group: int) -> jax.Array:
    """SnapKV's score from ``mass`` ``[B, H_kv, S]`` (window-averaged attention summed over the
    ``group`` query heads of each K/V head): an average pool of ``kernel_size`` along the slots
    (zero padded, divided by the kernel), divided by ``group`` (the mean over the query heads)."""
    pad = kernel_size // 2
    padded = jnp.pad(mass, ((0, 0), (0, 0), (pad, pad)))
    windows = sum(padded[..., i : i + mass.shape[-1]] for i in range(kernel_size))
    return windows / (kernel_size * group)


def key_norm_scores(keys: jax.Array) -> jax.Array:
    """``-||k||`` ``[B, H_kv, T]`` in float32 of keys ``[B, H_kv, T, D]``."""
    return -jnp.linalg.norm(keys.astype(jnp.float32), axis=-1)
