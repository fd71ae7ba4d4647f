"""One prefill for a whole grid of caches: an observer cache holds every token of a context with
what each eviction policy ranks tokens by, and ``refill`` turns it into any cache of the same model.

``jaxkv experiment``'s retrieval tasks prefill each batch of contexts once this way
(``jaxkv.research.tasks.ContextPrefills``) and refill from it every cell's cache: the plain cache,
each quantized format and each eviction policy at each budget. Each is the cache one update of the
context's tokens leaves (an evicting one: the layer a prefill at its budget leaves), the context's
own attention having read its K/V in full precision (kvpress's protocol: the press compresses after
the context's forward pass).

* ``Observer(window)``: how an observer cache is built, passed to ``init_cache`` /
  ``Cache.from_layer_types`` as ``layer_builder`` (the core's hook for layers built otherwise than
  by ``jaxkv.cache.LAYER_TYPES``): full-attention layers become ``ObserverLayer``s, sliding rings
  span ``max_length`` (they hold every token; their mask keeps the window), the other types are
  built as usual; chunked and hybrid layers are refused.
* ``ObserverLayer``: every token held (slot = position) with both attention scorings recorded from
  the one softmax attention computes; ``evict_to`` cuts any policy's ``EvictingLayer`` at any
  budget from it.
* ``refill(source, target)``: ``target`` (an empty cache of the same model) filled from
  ``source`` by the layers' ``Refill`` and ``HeldTokens`` capabilities (``jaxkv.protocol``);
  pure and jittable.

    observed = prefill_prefix(model, prompts, max_length=2048, layer_builder=Observer())
    fill = jax.jit(refill)  # one compile per target cache shape
    h2o = fill(observed, model.init_cache(len(prompts), 2048, eviction=EvictionSpec("h2o", budget=256)))
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.cache import LAYER_TYPES, Cache, LayerSpec
from jaxkv.eviction import DEFAULT_WINDOW, EvictionSpec, key_norm_scores, window_query_weights, window_scores
from jaxkv.layers.evicting import HEAD_SLOT_AXES, Candidates, EvictingLayer, Read, kept_stack
from jaxkv.protocol import (
    CacheLayer,
    Eviction,
    PositionalLayer,
    Refill,
    Rollback,
    check_capacity,
    check_update_inputs,
    entry,
    pytree_class,
    require,
)
from jaxkv.sharding import BATCH, Axes

# Layer types whose tokens an observer cache cannot hold with both scorings.
_UNOBSERVED = ("chunked_attention", "hybrid", "hybrid_sliding")


@dataclasses.dataclass(frozen=True)
class Observer:
    """A prefill every policy can be cut from (``layer_builder=Observer(...)``): full-attention
    layers keep every token and record both attention scorings, SnapKV's (the last ``window``
    queries: the window of the ``snapkv``/``pyramidkv`` specs it will serve) and H2O's (every
    query); sliding layers keep every token too (a ring spanning ``max_length``)."""

    window: int = DEFAULT_WINDOW

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"Observer: window must be at least 1 query, got {self.window}")

    def build(self, layer_type: str, spec: LayerSpec) -> CacheLayer:
        """The layer of ``layer_type`` in an observer cache (``jaxkv.cache.LayerBuilder``)."""
        if layer_type in _UNOBSERVED:
            raise ValueError(f"an Observer covers full and sliding attention; {layer_type} layers are not observed")
        _check_plain(spec)
        if layer_type == "full_attention":
            return ObserverLayer.create(
                spec.batch_size, spec.num_kv_heads, spec.head_dim, spec.max_length, self.window, spec.dtype
            )
        if layer_type == "sliding_attention" and spec.sliding_window:
            # The ring spans max_length, so it still holds every token for a refill (its mask keeps the window).
            extra = max(spec.max_length - spec.sliding_window, 0)
            spec = dataclasses.replace(spec, rollback_slots=spec.rollback_slots + extra)
        return LAYER_TYPES[layer_type].build(spec)


def _check_plain(spec: LayerSpec) -> None:
    """An observer cache stores plain K/V of ``max_length`` tokens (what every refill target reads)."""
    others = [name for name in ("quantization", "paging", "eviction", "retrieval") if getattr(spec, name) is not None]
    if others or spec.full_attention != "static" or spec.max_length is None:
        raise ValueError(
            f"an Observer cache holds plain K/V of max_length tokens: pass max_length, full_attention='static' "
            f"and no {' or '.join(others) or 'quantization, paging or eviction'}; refill the cache you want "
            f"from it (jaxkv.research.observer.refill)"
        )


@pytree_class
class ObserverLayer(PositionalLayer, Eviction):
    """Full attention over every token, slot ``p`` holding position ``p`` (as ``StaticLayer``),
    recording what each eviction policy ranks tokens by, so that one prefill serves every policy
    and budget (``evict_to``; ``Observer``): ``[B, H_kv, S, D]``.

    Per slot: ``window_mass``, the attention the observation window (a row's last ``window``
    positions) of the latest update gave it, averaged over those queries and over the query heads
    of its K/V head (SnapKV's score before pooling); ``accumulated_mass``, the attention every
    query gave it, summed (H2O's); ``rescored`` ``[B]``: whether that update brought the row a
    whole window (SnapKV then leaves the window's own slots unscored). Both come from the one
    softmax attention computes (``read`` with two query weightings). Cut from a layer filled in one
    update (a prefill), ``evict_to(spec)`` is the layer a prefill at ``spec``'s budget leaves; an
    update that brings less than a window (decoding) adds its queries' mass to its new slots only.
    """

    keys: jax.Array  # [B, H_kv, S, D]
    values: jax.Array  # [B, H_kv, S, D]
    lengths: jax.Array  # [B] int32
    window_mass: jax.Array  # [B, H_kv, S] float32
    accumulated_mass: jax.Array  # [B, H_kv, S] float32
    rescored: jax.Array  # [B] bool
    window: int = struct.field(pytree_node=False, default=DEFAULT_WINDOW)

    WHY_NOT = {
        Rollback: "an observer cannot undo the attention it recorded; refill a cache from it "
        "(jaxkv.research.observer.refill) first"
    }

    @classmethod
    def create(cls, batch_size, num_kv_heads, head_dim, max_length: int, window: int, dtype=jnp.float32):
        if max_length <= 0:
            raise ValueError(f"ObserverLayer: max_length must be positive, got {max_length}")
        shape = (batch_size, num_kv_heads, max_length)
        return cls(
            keys=jnp.zeros((*shape, head_dim), dtype),
            values=jnp.zeros((*shape, head_dim), dtype),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            window_mass=jnp.zeros(shape, jnp.float32),
            accumulated_mass=jnp.zeros(shape, jnp.float32),
            rescored=jnp.zeros((batch_size,), bool),
            window=window,
        )

    def logical_axes(self):
        return (
            super()
            .logical_axes()
            .replace(window_mass=HEAD_SLOT_AXES, accumulated_mass=HEAD_SLOT_AXES, rescored=Axes(BATCH))
        )

    def update_entry(self, index, keys, values, positions):
        raise TypeError(
            "ObserverLayer records the attention each token receives: store and attend in one call with "
            "jaxkv.attention.cached_attention(cache, layer_idx, queries, keys, values, positions), not Cache.update"
        )

    def attend_entry(self, index, queries, keys, values, positions, read: Read):
        """Store ``keys``/``values`` ``[B, H_kv, T, D]`` at ``positions`` ``[B, T]``, attend ``queries``
        ``[B, H_q, T, D]`` over every held slot and record both masses; returns the stack and the output."""
        positions = check_update_inputs(self, index, keys, values, positions)
        check_capacity(self, positions, self.capacity)
        before = entry(self.lengths, index)
        layer, view = self.write(index, keys, values, positions)
        lengths = entry(layer.lengths, index)
        real = positions >= 0
        window_weights = window_query_weights(positions, lengths, self.window)
        out, mass = read(queries, view, positions, jnp.stack([window_weights, real.astype(jnp.float32)], axis=-1))
        window_new = mass[..., 0] / (queries.shape[1] // keys.shape[1])  # the mean over the query heads
        rescored = jnp.sum(real, axis=1) >= self.window
        fresh = view.mask_info.kv_positions >= before[:, None]  # [B, S]: the slots this update wrote
        old = entry(self.window_mass, index)
        window_mass = jnp.where(
            rescored[:, None, None], window_new, old + jnp.where(fresh[:, None], window_new, 0.0)
        )  # fmt: skip
        layer = layer.replace(
            window_mass=layer.window_mass.at[index].set(window_mass),
            accumulated_mass=layer.accumulated_mass.at[index].add(mass[..., 1]),
            rescored=layer.rescored.at[index].set(rescored | entry(self.rescored, index)),
        )
        return layer, out

    def policy_scores(self, spec: EvictionSpec, positions: jax.Array) -> jax.Array:
        """``[L, B, H_kv, S]`` float32: every held slot's score under ``spec``'s policy (higher is
        kept), as a prefill into ``spec``'s layer would have scored it; ``positions`` ``[L, B, H_kv, S]``."""
        if spec.policy == "streaming_llm":
            return positions.astype(jnp.float32)
        if spec.policy == "key_norm":
            return key_norm_scores(self.keys)
        if spec.policy == "h2o":
            return self.accumulated_mass
        scores = lambda mass, positions, lengths, rescored: window_scores(  # noqa: E731
            mass, positions, lengths, self.window, rescored, spec.kernel_size, 1
        )  # the mass is already the mean over the query heads
        return jax.vmap(scores)(self.window_mass, positions, self.lengths, self.rescored)

    def evict_to(self, spec: EvictionSpec, layer_indices: list[int], num_layers: int) -> EvictingLayer:
        """This stack (leaves ``[L, ...]``) cut to ``spec``'s budgets by ``spec``'s policy: an
        ``EvictingLayer`` stack (see ``kept_stack``). SnapKV's and PyramidKV's window must be the
        observer's."""
        if spec.observation_window not in (None, self.window):
            raise ValueError(
                f"an observer of window {self.window} cannot score {spec.policy!r} with window "
                f"{spec.observation_window}: prefill with Observer(window={spec.observation_window})"
            )
        slot = jnp.arange(self.capacity, dtype=jnp.int32)
        positions = jnp.where(slot < self.lengths[..., None], slot, -1)[:, :, None]  # [L, B, 1, S]
        positions = jnp.broadcast_to(positions, self.window_mass.shape)
        held = Candidates(self.keys, self.values, positions, self.policy_scores(spec, positions))
        return kept_stack(spec, self.capacity, held, self.lengths, layer_indices, num_layers)

    @property
    def max_length(self) -> int:
        return self.capacity

    def describe(self) -> str:
        return f"observer window={self.window}"


def refill(source: Cache, target: Cache) -> Cache:
    """``target`` (an empty cache of the same model and rows, built with any options) holding
    ``source``'s tokens as one update of them would leave it (``Refill.filled_from``): a plain,
    quantized or ring layer stores the K/V as given, an evicting layer keeps its budget by its
    policy's scores. ``source`` must hold every token the target may attend to and the scores its
    policies rank by: a prefill into an ``Observer`` cache. So one prefill serves a grid of caches,
    each compressing the same context after the context's own attention read it in full precision.
    Pure: jit it to compile once per target shape."""
    if (target.layer_types, target.period) != (source.layer_types, source.period):
        raise ValueError(
            f"refill: the target has layer types {target.layer_types} in groups of {target.period}, the source "
            f"{source.layer_types} in groups of {source.period}; build both for one model (both stacked or not)"
        )
    for empty in target.groups:
        require(empty, Refill)
    num_layers = len(source.layer_types)
    groups = tuple(
        empty.filled_from(held, source.group_layers(g), num_layers)
        for g, (held, empty) in enumerate(zip(source.groups, target.groups))
    )
    return target.replace(groups=groups).constrained()
