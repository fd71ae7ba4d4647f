"""Full attention over a fixed budget of slots, evicting by a policy (``jaxkv.eviction``).

Each update attends over the kept slots followed by the new tokens (the candidates), then keeps
the ``budget`` best candidates of every row and K/V head: sinks and recent positions always,
the rest by the policy's score. Heads keep different positions, so ``slot_positions`` (and the
``kv_positions`` attention reads) are ``[B, H_kv, N]``. Kept slots stay in position order.

Attention-scored policies (SnapKV, PyramidKV, H2O) take the attention each candidate received
from this update's queries, which the attention call returns with its output (``attend_entry``'s
``read``): no second pass over the keys. The layer therefore takes ``attend_entry`` (model code
calls ``jaxkv.attention.cached_attention``), not a bare ``update``.

What cannot be undone: evicted K/V are gone. ``max_rollback`` is 0, so ``rollback`` of any
token is an error eagerly and a no-op under jit, and speculative decoding (which rolls back
rejected drafts) refuses an evicting cache. Beam search and batch edits gather whole rows and
work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.eviction import EvictionSpec, key_norm_scores, pooled_window_mass
from jaxkv.protocol import KV_AXES, BatchMajorLayer, KVView, MaskInfo, check_update_inputs, entry, lengths_after
from jaxkv.protocol import PackedRowsLayer, limit_rollback, stacked_for_layers
from jaxkv.sharding import BATCH, KV_HEADS, KV_SLOTS, Axes

# read(queries [B, H_q, T, D], view, positions [B, T], query_weights [B, T] or None)
#   -> (attention output [B, H_q, T, D], slot mass [B, H_kv, S] or None)
Read = Callable[[jax.Array, KVView, jax.Array, jax.Array | None], tuple[jax.Array, jax.Array | None]]
HEAD_SLOT_AXES = Axes(BATCH, KV_HEADS, KV_SLOTS)  # [B, H_kv, N]


@struct.dataclass
class Candidates:
    """The kept slots of one layer followed by the T new tokens: ``C = N + T`` candidates per head."""

    keys: jax.Array  # [B, H_kv, C, D]
    values: jax.Array  # [B, H_kv, C, D]
    positions: jax.Array  # [B, H_kv, C] int32, -1 = empty or padding
    old_scores: jax.Array  # [B, H_kv, N] float32: the kept slots' stored scores


@struct.dataclass
class EvictingLayer(BatchMajorLayer):
    """Full-attention K/V in ``N`` slots per row and head, evicted by a policy: ``[B, H_kv, N, D]``."""

    keys: jax.Array  # [B, H_kv, N, D]
    values: jax.Array  # [B, H_kv, N, D]
    slot_positions: jax.Array  # [B, H_kv, N] int32, -1 = empty or evicted
    scores: jax.Array  # [B, H_kv, N] float32: the policy's score of each kept slot
    lengths: jax.Array  # [B] int32: tokens seen, not slots filled
    budget: jax.Array  # [B] int32: slots this layer keeps (<= N; PyramidKV's differ per layer)
    spec: EvictionSpec = struct.field(pytree_node=False)

    MEMORY_FORMULA = "2·B·N·H_kv·D·bytes + 8·B·N·H_kv + 8·B"

    @classmethod
    def create(cls, batch_size, num_kv_heads, head_dim, spec: EvictionSpec, slots: int, dtype=jnp.float32):
        """``slots`` per row and head for a resolved ``spec`` (a budget, not a ratio)."""
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
        """This stack (leaves ``[L, ...]``), entry j keeping model layer ``layer_indices[j]``'s
        budget of ``EvictionSpec.layer_budgets`` (PyramidKV's differ by depth)."""
        budgets = self.spec.layer_budgets(num_layers)
        for budget in budgets:
            self.spec.check_budget(budget)
        per_layer = jnp.asarray([budgets[i] for i in layer_indices], jnp.int32)[:, None]
        return self.replace(budget=jnp.broadcast_to(per_layer, self.budget.shape))

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
        layer = jax.tree.map(lambda leaf: entry(leaf, index), self)
        lengths = lengths_after(layer.lengths, positions)
        candidates = layer.candidates(keys, values, positions)
        weights = self.query_weights(positions, lengths) if self.spec.uses_attention else None
        view = KVView.of(candidates.keys, candidates.values, MaskInfo(candidates.positions))
        out, mass = read(queries, view, positions, weights)
        group = queries.shape[1] // keys.shape[1]
        scores = self.candidate_scores(candidates, keys, mass, positions, lengths, group)
        kept = layer.keep(candidates, scores, lengths)
        stack = jax.tree.map(lambda leaf, new: leaf.at[index].set(new), self, kept)
        return stack, out

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
        real = positions >= 0
        if self.spec.policy == "h2o":
            return real.astype(jnp.float32)
        observing = real & (positions >= (lengths - self.window)[:, None])
        return observing / jnp.maximum(jnp.sum(observing, axis=1, keepdims=True), 1)

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
        in_window = candidates.positions >= (lengths - self.window)[:, None, None]
        pooled = pooled_window_mass(
            jnp.where(rescored[:, None, None] & in_window, 0.0, mass), self.spec.kernel_size, group
        )
        kept_scores = jnp.concatenate([candidates.old_scores, pooled[..., -num_new:]], axis=2)
        return jnp.where(rescored[:, None, None], pooled, kept_scores)

    def keep(self, candidates: Candidates, scores: jax.Array, lengths: jax.Array) -> EvictingLayer:
        """The best ``budget`` candidates of each row and head, in position order: sinks and the
        recent window first (always kept), then by ``scores``; empty and padding never."""
        positions, num_slots = candidates.positions, self.keys.shape[-2]
        num_candidates = positions.shape[-1]
        protected = (positions < self.spec.sink_count()) | (positions >= (lengths - self.window)[:, None, None])
        ranking = jnp.where(positions < 0, -jnp.inf, jnp.where(protected, jnp.inf, scores))
        best_rank, best = jax.lax.top_k(ranking, num_slots)  # [B, H_kv, N], best first
        chosen = (jnp.arange(num_slots) < self.budget[:, None, None]) & (best_rank > -jnp.inf)
        # Sorting the chosen candidate indices (the rest after them) restores position order.
        order = jnp.sort(jnp.where(chosen, best, num_candidates + best), axis=-1)
        held = order < num_candidates
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
        slots than the layer has; a ``compression_ratio`` resolves against the slots held (the
        observer's ``max_length``), not the tokens seen. From a layer that evicted nothing yet
        (``EvictionSpec.observer``), this is the layer that one update of the same tokens at
        ``spec``'s budget leaves; from one that did evict, it evicts again from what is left."""
        if spec.scoring() != self.spec.scoring():
            raise ValueError(
                f"cannot evict a cache scored as {self.spec.scoring()} to {spec.policy!r}, which scores as "
                f"{spec.scoring()}: prefill with {spec.policy!r}'s EvictionSpec.observer(slots) first"
            )
        held = self.keys.shape[-2]
        spec = spec.resolved(held)
        budgets = spec.layer_budgets(num_layers)
        if max(budgets) > held:
            raise ValueError(f"cannot evict to {max(budgets)} slots: this layer holds {held}; give a smaller budget")
        batch, heads, _, head_dim = self.keys.shape[1:]
        empty = EvictingLayer.create(batch, heads, head_dim, spec, max(budgets), self.keys.dtype)
        target = stacked_for_layers(empty, layer_indices, num_layers)
        held_slots = Candidates(self.keys, self.values, self.slot_positions, self.scores)
        return jax.vmap(lambda layer, c, lengths: layer.keep(c, c.old_scores, lengths))(
            target, held_slots, self.lengths
        )

    # --- edits, capacity -------------------------------------------------------------------
    def logical_axes(self):
        return self.replace(
            keys=KV_AXES, values=KV_AXES, slot_positions=HEAD_SLOT_AXES, scores=HEAD_SLOT_AXES,
            lengths=Axes(BATCH), budget=Axes(BATCH),
        )  # fmt: skip

    @property
    def max_length(self) -> None:
        return None  # never overflows: it evicts

    @property
    def max_rollback(self) -> int:
        return 0

    def rollback_hint(self, num_tokens: int) -> str:
        return (
            "an evicting layer cannot undo tokens: the K/V it evicted to make room for them are gone. Roll back "
            "(or decode speculatively) with a cache built without eviction"
        )

    def rollback(self, num_tokens):
        return self.replace(lengths=self.lengths - limit_rollback(self, num_tokens, self.lengths))

    def reset(self):
        """Every slot empty (position -1), the budgets kept."""
        empty = jax.tree.map(jnp.zeros_like, self)
        return empty.replace(slot_positions=jnp.full_like(self.slot_positions, -1), budget=self.budget)

    def describe(self) -> str:
        return f"{self.spec.policy} N={self.keys.shape[-2]}"


@struct.dataclass
class PackedEvictingLayer(PackedRowsLayer):
    """Evicting K/V for the serving engine: an ``EvictingLayer`` with one row per engine row
    (``slots``), fed with packed tokens of many rows (``PackedRowsLayer``). Each row holds its
    budget of slots whatever its length, so evicted layers take no pages: the engine's memory
    for them is fixed by ``max_num_seqs``.

    A prefill chunk is one update: the policy scores and evicts after each chunk, as a cache fed
    the prompt in those chunks would (SnapKV's observation window is each chunk's last tokens).
    """

    slots: EvictingLayer
    token_rows: jax.Array  # [N] int32
    tokens_per_row: int = struct.field(pytree_node=False, default=1)

    MEMORY_FORMULA = EvictingLayer.MEMORY_FORMULA + "; B engine rows"
    kv_bytes = staticmethod(EvictingLayer.kv_bytes)

    def for_layers(self, layer_indices: list[int], num_layers: int) -> PackedEvictingLayer:
        return self.replace(slots=self.slots.for_layers(layer_indices, num_layers))

    def update_entry(self, index, keys, values, positions):
        return self.slots.update_entry(index, keys, values, positions)  # raises: use cached_attention

    def evict_to(self, spec, layer_indices, num_layers):
        raise TypeError("Cache.evict cuts the rows of a cache built for generate; the engine's rows are not cut")

    def attend_entry(self, index, queries, keys, values, positions, read: Read):
        """``EvictingLayer.attend_entry`` of packed ``[1, H, N, D]`` tokens at ``positions`` ``[1, N]``;
        the output comes back packed ``[1, H_q, N, D]`` (zeros at padding)."""
        slots, packing = self.packing(index, positions[0])

        def unpacked(x: jax.Array) -> jax.Array:  # [1, H, N, D] -> [R, H, T, D]
            return jnp.moveaxis(packing.unpacked(jnp.moveaxis(x[0], 1, 0), 0), 2, 1)

        slots, out = slots.attend_entry(
            index, unpacked(queries), unpacked(keys), unpacked(values), packing.unpacked(positions[0], -1), read
        )
        return self.replace(slots=slots), jnp.moveaxis(packing.packed(jnp.moveaxis(out, 2, 1)), 1, 0)[None]
