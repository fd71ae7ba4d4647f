"""Full attention over a fixed budget of slots, evicting by a policy (``jaxkv.eviction``).

Each update attends over the kept slots followed by the new tokens (the candidates), then keeps
the ``budget`` best candidates of every row and K/V head: sinks and recent positions always,
the rest by the policy's score. Heads keep different positions, so ``slot_positions`` (and the
``kv_positions`` attention reads) are ``[B, H_kv, N]``. Kept slots stay in position order.

Attention-scored policies (SnapKV, PyramidKV, H2O) take the attention each candidate received
from this update's queries, which the attention call returns with its output (``attend_entry``'s
``read``): no second pass over the keys. The layer therefore takes ``attend_entry`` (model code
calls ``jaxkv.attention.cached_attention``), not a bare ``update``.

PyramidKV's budgets differ by depth, but a stack of layers shares one shape. Its linear schedule
makes the budgets of entries j and L-1-j sum to twice the mean, so the stack pairs them
(``paired``): each entry holds ``E`` = that mean (rounded up) slots, a layer over its share takes
the rest of its slots from its partner's entry, and the stack holds what the layers keep, not
``L`` times the first layer's budget. An update reads both entries (``entry_view``: ``2E`` slots,
the partner's at position -1) and writes back only the slots the layer owns (``store_entry``).

``kept_stack`` cuts slots held with their scores (``Candidates``) to a spec's budgets: an evicting
layer's own (``evict_to``), or those of any layer that holds every token with the scores a policy
ranks by (``filled_from`` cuts an empty evicting layer from such a source's ``evict_to``).

What cannot be undone: evicted K/V are gone. The layers have no ``Rollback``, so a rollback
of any token is an error eagerly and a no-op under jit, and speculative decoding (which rolls back
rejected drafts) refuses an evicting cache. Beam search and batch edits gather whole rows and
work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.batch import PackedAttention, PackedBatch
from jaxkv.eviction import EvictionSpec, key_norm_scores, window_query_weights, window_scores
from jaxkv.protocol import (
    KV_AXES,
    BatchMajorLayer,
    DepthBudgets,
    Eviction,
    KVView,
    MaskInfo,
    PackedRowsLayer,
    Refill,
    Rollback,
    check_update_inputs,
    entry,
    lengths_after,
    pytree_class,
    require,
    stacked_for_layers,
)
from jaxkv.sharding import BATCH, KV_HEADS, KV_SLOTS, Axes

# read(queries [B, H_q, T, D], view, positions [B, T], query_weights [B, T] or None)
#   -> (attention output [B, H_q, T, D], slot mass [B, H_kv, S] or None)
Read = Callable[[jax.Array, KVView, jax.Array, jax.Array | None], tuple[jax.Array, jax.Array | None]]
HEAD_SLOT_AXES = Axes(BATCH, KV_HEADS, KV_SLOTS)  # [B, H_kv, N]
SLOT_LEAVES = ("keys", "values", "slot_positions", "scores")  # the leaves with a slot axis (axis 2 of an entry)


def paired_slots(budgets: list[int]) -> int:
    """Slots per entry of a stack whose entries keep ``budgets``: entries j and L-1-j share theirs,
    so each holds their mean, rounded up (the largest budget when every budget is equal)."""
    return max(-(-(budgets[j] + budgets[-1 - j]) // 2) for j in range(len(budgets)))


def along_slots(mask: jax.Array, leaf: jax.Array) -> jax.Array:
    """``mask`` ``[B, S]`` shaped to broadcast over a slot leaf ``[B, H_kv, S]`` or ``[B, H_kv, S, D]``."""
    return mask.reshape(mask.shape[0], 1, mask.shape[1], *[1] * (leaf.ndim - 3))


def rotate(x: jax.Array, shift: jax.Array, axis: int) -> jax.Array:
    """``x`` (rows first) with each row r's slots (``axis``) rotated: slot s becomes slot ``(s - shift[r]) mod S``."""
    num_slots = x.shape[axis]
    source = (jnp.arange(num_slots) + shift[:, None]) % num_slots  # [B, S]
    index = source.reshape(source.shape[0], *[1] * (axis - 1), num_slots, *[1] * (x.ndim - axis - 1))
    return jnp.take_along_axis(x, index, axis=axis)


def slot_leaves(layer, fn) -> dict[str, jax.Array]:
    """``fn(name, leaf)`` of each slot leaf of ``layer``, by name (for ``layer.replace``)."""
    return {name: fn(name, getattr(layer, name)) for name in SLOT_LEAVES}


@pytree_class
class Candidates:
    """The kept slots of one layer followed by the T new tokens: ``C = N + T`` candidates per head."""

    keys: jax.Array  # [B, H_kv, C, D]
    values: jax.Array  # [B, H_kv, C, D]
    positions: jax.Array  # [B, H_kv, C] int32, -1 = empty or padding
    old_scores: jax.Array  # [B, H_kv, N] float32: the kept slots' stored scores


@pytree_class
class EvictingLayer(BatchMajorLayer, Eviction, DepthBudgets, Refill):
    """Full-attention K/V in ``N`` slots per row and head, evicted by a policy: ``[B, H_kv, N, D]``."""

    keys: jax.Array  # [B, H_kv, N, D]
    values: jax.Array  # [B, H_kv, N, D]
    slot_positions: jax.Array  # [B, H_kv, N] int32, -1 = empty or evicted
    scores: jax.Array  # [B, H_kv, N] float32: the policy's score of each kept slot
    lengths: jax.Array  # [B] int32: tokens seen, not slots filled
    budget: jax.Array  # [B] int32: slots this layer keeps (<= N; PyramidKV's differ per layer)
    spec: EvictionSpec = struct.field(pytree_node=False)
    # Entries j and L-1-j share their 2N slots (PyramidKV's budgets; see the module docstring).
    paired: bool = struct.field(pytree_node=False, default=False)

    MEMORY_FORMULA = "2·B·N·H_kv·D·bytes + 8·B·N·H_kv + 8·B"
    WHY_NOT = {
        Rollback: "an evicting layer cannot undo tokens: the K/V it evicted to make room for them are gone. Roll "
        "back (or decode speculatively) with a cache built without eviction"
    }

    @classmethod
    def create(cls, batch_size, num_kv_heads, head_dim, spec: EvictionSpec, slots: int, dtype=jnp.float32):
        """``slots`` per row and head for a ``resolved`` spec (a budget, not a ratio; PyramidKV: its prompt length)."""
        spec.check_budget(slots)
        shape = (batch_size, num_kv_heads, slots)
        return cls(
            keys=jnp.zeros((*shape, head_dim), dtype),
            values=jnp.zeros((*shape, head_dim), dtype),
            slot_positions=jnp.full(shape, -1, jnp.int32),
            scores=jnp.zeros(shape, jnp.float32),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            budget=jnp.full((batch_size,), slots, jnp.int32),
            spec=spec,
        )

    @staticmethod
    def kv_bytes(batch_size, seq_len, num_kv_heads, head_dim, dtype, slots=None, **_) -> int:
        """Bytes of ``slots`` slots (default ``seq_len``) per row and head, whatever ``seq_len``."""
        slots = slots or seq_len
        kv = 2 * batch_size * slots * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
        return kv + 8 * batch_size * slots * num_kv_heads + 8 * batch_size

    def for_layers(self, layer_indices: list[int], num_layers: int) -> EvictingLayer:
        """This stack (leaves ``[L, ...]``, as created: empty, ``max`` budget slots), entry j keeping
        model layer ``layer_indices[j]``'s budget of ``EvictionSpec.layer_budgets``. Budgets that differ
        by depth (PyramidKV's) pair the entries and cut every entry to its pair's mean; a stack of one
        budget below the largest (a layer of its own, ``Cache(stacked=False)``) is cut to it."""
        all_budgets = self.spec.layer_budgets(num_layers)
        for budget in all_budgets:
            self.spec.check_budget(budget)
        budgets = [all_budgets[i] for i in layer_indices]
        per_layer = jnp.asarray(budgets, jnp.int32)[:, None]
        stack = self.replace(budget=jnp.broadcast_to(per_layer, self.budget.shape))
        size = paired_slots(budgets)
        if size == self.keys.shape[-2]:
            return stack
        cut = slot_leaves(stack, lambda _, leaf: leaf[:, :, :, :size])
        # Entries of one budget (an unstacked cache's single entry) need no partner: cut to it.
        return stack.replace(paired=len(set(budgets)) > 1, **cut)

    # --- entries and the slots they own -------------------------------------------------------
    # Paired, a layer of budget b <= E owns the first b slots of its entry; one of b > E owns its
    # whole entry and the last b - E slots of its partner's (which keeps at most 2E - b). In the
    # concatenation [own entry, partner entry] that is a cyclic run of b slots from slot 0 or 3E - b.
    # The view rotates the run to the end, so the layer's slots sit where a b-slot layer's would:
    # right before the new tokens it is updated with (SnapKV pools scores over neighbouring slots).
    def entry_view(self, index) -> EvictingLayer:
        """Entry ``index`` as one layer; paired, ``2E`` slots (``[B, H_kv, 2E, ...]``) of its own and its
        partner's entries, those it owns last, the others at position -1."""
        if not self.paired:
            return super().entry_view(index)
        partner = self.keys.shape[0] - 1 - index
        layer = jax.tree.map(lambda leaf: entry(leaf, index), self)
        layer = layer.replace(
            **slot_leaves(layer, lambda name, own: jnp.concatenate([own, entry(getattr(self, name), partner)], axis=2))
        )
        return layer.rotated(layer.rotation()).with_owned_positions()

    def store_entry(self, index, layer: EvictingLayer) -> EvictingLayer:
        """Entry ``index`` replaced by ``layer`` (an updated ``entry_view``); paired, only the slots it owns."""
        if not self.paired:
            return super().store_entry(index, layer)
        # Each slot the layer owns goes back where its view read it from; the others are dropped,
        # so the partner's slots are neither read again nor rewritten.
        size, partner = self.keys.shape[-2], self.keys.shape[0] - 1 - index
        stored = (jnp.arange(2 * size) + layer.rotation()[:, None]) % (2 * size)  # [B, 2E] in [own, partner]
        entries = jnp.where(stored < size, index, partner)
        slots = jnp.where(layer.owned(), stored % size, size)  # size: out of range, dropped
        rows = jnp.arange(self.keys.shape[1])[:, None]

        def written(name: str, stack: jax.Array) -> jax.Array:
            return stack.at[entries, rows, :, slots].set(jnp.swapaxes(getattr(layer, name), 1, 2), mode="drop")

        return self.replace(
            **slot_leaves(self, written),
            lengths=self.lengths.at[index].set(layer.lengths),
            budget=self.budget.at[index].set(layer.budget),
        )

    def rotation(self) -> jax.Array:
        """``[B]``: how far a paired view is rotated from ``[own entry, partner entry]``."""
        return jnp.minimum(self.budget, self.keys.shape[-2] // 2)

    def rotated(self, shift: jax.Array) -> EvictingLayer:
        """This (single) layer's slots rotated by ``shift`` ``[B]`` (``rotate``)."""
        return self.replace(**slot_leaves(self, lambda _, leaf: rotate(leaf, shift, axis=2)))

    def owned(self) -> jax.Array:
        """``[B, 2E]`` bool of a paired ``entry_view``: its last ``budget`` slots."""
        return jnp.arange(self.keys.shape[-2]) >= self.keys.shape[-2] - self.budget[:, None]

    def with_owned_positions(self) -> EvictingLayer:
        """This ``entry_view`` with the slots it does not own at position -1."""
        return self.replace(slot_positions=jnp.where(self.owned()[:, None], self.slot_positions, -1))

    def entry_views(self) -> EvictingLayer:
        """Every entry's ``entry_view`` at once (leaves ``[L, ...]``; this stack when not paired)."""
        if not self.paired:
            return self
        shared = self.replace(**slot_leaves(self, lambda _, leaf: jnp.concatenate([leaf, leaf[::-1]], axis=3)))
        return jax.vmap(lambda layer: layer.rotated(layer.rotation()).with_owned_positions())(shared)

    def from_entry_views(self, views: EvictingLayer) -> EvictingLayer:
        """The stack whose ``entry_views`` are ``views`` (each slot from the view of the layer owning it)."""
        if not self.paired:
            return views
        size = self.keys.shape[-2]

        def unrotated(view: EvictingLayer) -> tuple[EvictingLayer, jax.Array]:  # as stored, and the owned [B, 2E]
            shift = -view.rotation()
            return view.rotated(shift), rotate(view.owned(), shift, axis=1)

        def stored(view: EvictingLayer, partner: EvictingLayer) -> EvictingLayer:
            (view, owned), (partner, _) = unrotated(view), unrotated(partner)
            mine = owned[:, :size]
            return view.replace(**slot_leaves(view, lambda name, leaf: jnp.where(
                along_slots(mine, leaf), leaf[:, :, :size], getattr(partner, name)[:, :, size:]
            )))  # fmt: skip

        return jax.vmap(stored)(views, jax.tree.map(lambda leaf: leaf[::-1], views))

    def unstacked(self, index: int) -> EvictingLayer:
        """Entry ``index`` as a layer of exactly its budget of slots (paired: gathered from both entries)."""
        if not self.paired:
            return super().unstacked(index)
        layer = self.entry_view(index)
        count = int(jnp.max(layer.budget))
        return layer.replace(paired=False, **slot_leaves(layer, lambda _, leaf: leaf[:, :, -count:]))

    # --- the update -----------------------------------------------------------------------
    def update_entry(self, index, keys, values, positions):
        raise TypeError(
            "EvictingLayer scores tokens by the attention they receive: store and attend in one call with "
            "jaxkv.attention.cached_attention(cache, layer_idx, queries, keys, values, positions), not Cache.update"
        )

    def attend_entry(self, index, queries, keys, values, positions, read: Read):
        """Attend ``queries`` ``[B, H_q, T, D]`` over entry ``index``'s kept slots and the new
        ``keys``/``values`` ``[B, H_kv, T, D]`` at ``positions`` ``[B, T]``, then keep the best
        ``budget`` of them. Returns the stack and the attention output ``[B, H_q, T, D]``."""
        positions = check_update_inputs(self, index, keys, values, positions)
        layer = self.entry_view(index)
        lengths = lengths_after(layer.lengths, positions)
        candidates = layer.candidates(keys, values, positions)
        weights = self.query_weights(positions, lengths) if self.spec.uses_attention else None
        view = KVView.of(candidates.keys, candidates.values, MaskInfo(candidates.positions))
        out, mass = read(queries, view, positions, weights)
        group = queries.shape[1] // keys.shape[1]
        scores = self.candidate_scores(candidates, keys, mass, positions, lengths, group)
        return self.store_entry(index, layer.keep(candidates, scores, lengths)), out

    def candidates(self, keys, values, positions) -> Candidates:
        """This (single) layer's slots followed by the new tokens, padding zeroed (a masked slot
        still enters the weighted sum with weight 0, and 0 * NaN is NaN) and at position -1."""
        real = positions >= 0
        new_positions = jnp.broadcast_to(jnp.where(real, positions, -1)[:, None], keys.shape[:3])
        zeroed = lambda x: jnp.where(real[:, None, :, None], x, 0)  # noqa: E731
        return Candidates(
            keys=jnp.concatenate([self.keys, zeroed(keys)], axis=2),
            values=jnp.concatenate([self.values, zeroed(values)], axis=2),
            positions=jnp.concatenate([self.slot_positions, new_positions], axis=2),
            old_scores=self.scores,
        )

    def query_weights(self, positions: jax.Array, lengths: jax.Array) -> jax.Array:
        """``[B, T]`` weight of each query in the attention mass the policy scores by: H2O sums
        every query; SnapKV averages the observation window's (the row's last ``window``)."""
        if self.spec.policy == "h2o":
            return (positions >= 0).astype(jnp.float32)
        return window_query_weights(positions, lengths, self.window)

    @property
    def window(self) -> int:
        return self.spec.window_for(self.spec.budget)

    def candidate_scores(self, candidates: Candidates, keys, mass, positions, lengths, group: int) -> jax.Array:
        """``[B, H_kv, C]`` float32 score of every candidate under the policy (higher is kept)."""
        policy, num_new = self.spec.policy, keys.shape[2]
        if policy == "streaming_llm":
            return candidates.positions.astype(jnp.float32)
        if policy == "key_norm":
            return jnp.concatenate([candidates.old_scores, key_norm_scores(keys)], axis=2)
        if policy == "h2o":
            return jnp.pad(candidates.old_scores, ((0, 0), (0, 0), (0, num_new))) + mass
        # SnapKV / PyramidKV: a row given a whole observation window (a prefill) rescores every
        # candidate, the window's own columns left out as kvpress leaves them out; a shorter
        # update scores its new tokens by its own queries and keeps the stored scores.
        rescored = jnp.sum(positions >= 0, axis=1) >= self.window
        pooled = window_scores(mass, candidates.positions, lengths, self.window, rescored, self.spec.kernel_size, group)
        kept_scores = jnp.concatenate([candidates.old_scores, pooled[..., -num_new:]], axis=2)
        return jnp.where(rescored[:, None, None], pooled, kept_scores)

    def keep(self, candidates: Candidates, scores: jax.Array, lengths: jax.Array) -> EvictingLayer:
        """The best ``budget`` candidates of each row and head, in position order: sinks and the
        recent window first (always kept), then by ``scores``; empty and padding never."""
        positions, num_slots = candidates.positions, self.keys.shape[-2]
        num_candidates = positions.shape[-1]
        order, held = kept_order(self.spec, self.window, positions, scores, lengths, self.budget, num_slots)
        if self.paired:  # the chosen, in order, into the slots this layer owns (its last budget)
            first = num_slots - self.budget[:, None, None]
            rank = jnp.maximum(jnp.arange(num_slots) - first, 0)
            order = jnp.take_along_axis(order, rank, axis=-1)
            held = jnp.take_along_axis(held, rank, axis=-1) & (jnp.arange(num_slots) >= first)
        order = order % num_candidates
        take = lambda x: jnp.take_along_axis(x, order, axis=2)  # noqa: E731
        take_rows = lambda x: jnp.take_along_axis(x, order[..., None], axis=2)  # noqa: E731
        return self.replace(
            keys=take_rows(candidates.keys),
            values=take_rows(candidates.values),
            slot_positions=jnp.where(held, take(positions), -1),
            scores=jnp.where(held, take(scores), 0.0),
            lengths=lengths,
        )

    def evict_to(self, spec: EvictionSpec, layer_indices: list[int], num_layers: int) -> EvictingLayer:
        """This stack (leaves ``[L, ...]``, entry j model layer ``layer_indices[j]``) cut to ``spec``'s
        budgets: each layer keeps the best of the slots it holds by their stored scores (sinks and
        ``spec``'s window always), in new arrays of ``max(spec.layer_budgets(num_layers))`` slots.
        ``spec`` must score as this layer's spec does (``EvictionSpec.scoring``) and not keep more
        slots than the layer has; a ``compression_ratio`` resolves against the slots held, not the
        tokens seen. From a layer that evicted nothing yet
        (``EvictionSpec.observer``), this is the layer that one update of the same tokens at
        ``spec``'s budget leaves; from one that did evict, it evicts again from what is left."""
        if spec.scoring() != self.spec.scoring():
            raise ValueError(
                f"cannot evict a cache scored as {self.spec.scoring()} to {spec.policy!r}, which scores as "
                f"{spec.scoring()}: prefill with {spec.policy!r}'s EvictionSpec.observer(slots) first"
            )
        held = self.entry_views()
        slots = Candidates(held.keys, held.values, held.slot_positions, held.scores)
        return kept_stack(spec, self.keys.shape[-2], slots, held.lengths, layer_indices, num_layers)

    def filled_from(self, source, layer_indices: list[int], num_layers: int) -> EvictingLayer:
        """This (empty) stack's spec cut from ``source``'s scores (``source.evict_to``): a layer with
        ``Eviction`` holding the tokens with the scores its policy ranks by (an evicting layer of the
        same scoring, or one that holds every token)."""
        require(
            source, Eviction, "an evicting layer is filled from the attention its policy ranks by: prefill into an "
            "Observer cache (layer_builder=jaxkv.research.observer.Observer(...))"
        )  # fmt: skip
        return source.evict_to(self.spec, layer_indices, num_layers)

    # --- edits, capacity -------------------------------------------------------------------
    def logical_axes(self):
        return self.replace(
            keys=KV_AXES, values=KV_AXES, slot_positions=HEAD_SLOT_AXES, scores=HEAD_SLOT_AXES,
            lengths=Axes(BATCH), budget=Axes(BATCH),
        )  # fmt: skip

    @property
    def max_length(self) -> None:
        return None  # never overflows: it evicts

    def reset(self):
        """Every slot empty (position -1), the budgets kept."""
        empty = jax.tree.map(jnp.zeros_like, self)
        return empty.replace(slot_positions=jnp.full_like(self.slot_positions, -1), budget=self.budget)

    def describe(self) -> str:
        return f"{self.spec.policy} N={self.keys.shape[-2]}{' paired' if self.paired else ''}"


def kept_order(
    spec: EvictionSpec, window: int, positions: jax.Array, scores: jax.Array, lengths: jax.Array, budget: jax.Array,
    num_slots: int,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Which of the candidates at ``positions`` ``[B, H_kv, C]`` (-1: empty) with ``scores`` keep
    the ``budget`` ``[B]`` slots of each row and head (of ``num_slots``), after ``lengths`` ``[B]``
    tokens seen: the sinks and the last ``window`` positions always, then the best scores (ties:
    the earlier candidate), empty never. Returns the candidate indices in position order
    ``[B, H_kv, num_slots]`` (those not kept after them, offset by ``C``) and whether each is kept."""
    num_candidates = positions.shape[-1]
    protected = (positions < spec.sink_count()) | (positions >= (lengths - window)[:, None, None])
    ranking = jnp.where(positions < 0, -jnp.inf, jnp.where(protected, jnp.inf, scores))
    best_rank, best = jax.lax.top_k(ranking, num_slots)  # [B, H_kv, N], best first
    chosen = (jnp.arange(num_slots) < budget[:, None, None]) & (best_rank > -jnp.inf)
    # Sorting the chosen candidate indices (the rest after them) restores position order.
    order = jnp.sort(jnp.where(chosen, best, num_candidates + best), axis=-1)
    return order, order < num_candidates


def kept_stack(
    spec: EvictionSpec, held_slots: int, held: Candidates, lengths: jax.Array, layer_indices: list[int], num_layers: int
) -> EvictingLayer:
    """A stack (entry j model layer ``layer_indices[j]``) of ``spec``'s budgets, each layer keeping
    the best of its ``held`` slots (leaves ``[L, ...]``, ranked by ``held.old_scores``; sinks and
    ``spec``'s window always) in new arrays of ``max(spec.layer_budgets(num_layers))`` slots. A
    ``compression_ratio`` resolves against ``held_slots``, the slots of the layer cut."""
    spec = spec.resolved(held_slots)
    budgets = spec.layer_budgets(num_layers)
    if max(budgets) > held_slots:
        raise ValueError(f"cannot evict to {max(budgets)} slots: this layer holds {held_slots}; give a smaller budget")
    batch, heads, _, head_dim = held.keys.shape[1:]
    empty = EvictingLayer.create(batch, heads, head_dim, spec, max(budgets), held.keys.dtype)
    target = stacked_for_layers(empty, layer_indices, num_layers)
    kept = jax.vmap(lambda layer, c, lengths: layer.keep(c, c.old_scores, lengths))(target.entry_views(), held, lengths)
    return target.from_entry_views(kept)


@pytree_class
class PackedEvictingLayer(PackedRowsLayer, DepthBudgets, PackedAttention):
    """Evicting K/V for the serving engine: an ``EvictingLayer`` with one row per engine row
    (``slots``), fed with packed tokens of many rows (``PackedRowsLayer``). Each row holds its
    budget of slots whatever its length, so evicted layers take no pages: the engine's memory
    for them is fixed by ``max_num_seqs``.

    A prefill chunk is one update: the policy scores and evicts after each chunk, as a cache fed
    the prompt in those chunks would (SnapKV's observation window is each chunk's last tokens).
    """

    slots: EvictingLayer

    MEMORY_FORMULA = EvictingLayer.MEMORY_FORMULA + "; B engine rows"
    WHY_NOT = {
        **PackedRowsLayer.WHY_NOT,
        Eviction: "Cache.evict cuts the rows of a cache built for generate; the engine's rows are not cut",
    }
    kv_bytes = staticmethod(EvictingLayer.kv_bytes)

    def for_layers(self, layer_indices: list[int], num_layers: int) -> PackedEvictingLayer:
        return self.replace(slots=self.slots.for_layers(layer_indices, num_layers))

    def update_entry(self, index, keys, values, positions):
        return self.slots.update_entry(index, keys, values, positions)  # raises: use cached_attention

    def attend_entry(self, index, queries, keys, values, positions, read: Read):
        raise TypeError("PackedEvictingLayer serves the engine's packed batch: Cache.attend(..., packed=PackedBatch)")

    def attend_packed_entry(self, index, queries, keys, values, positions, read: Read, packed: PackedBatch):
        """``EvictingLayer.attend_entry`` of packed ``[1, H, N, D]`` tokens at ``positions`` ``[1, N]``;
        the output comes back packed ``[1, H_q, N, D]`` (zeros at padding)."""
        slots, packing = self.packing(index, positions[0], packed)

        def unpacked(x: jax.Array) -> jax.Array:  # [1, H, N, D] -> [R, H, T, D]
            return jnp.moveaxis(packing.unpacked(jnp.moveaxis(x[0], 1, 0), 0), 2, 1)

        slots, out = slots.attend_entry(
            index, unpacked(queries), unpacked(keys), unpacked(values), packing.unpacked(positions[0], -1), read
        )
        return self.replace(slots=slots), jnp.moveaxis(packing.packed(jnp.moveaxis(out, 2, 1)), 1, 0)[None]
