"""Fixed-size state instead of per-token K/V: linear-attention / state-space layers, and
hybrid layers that hold such a state next to attention K/V.

A linear-attention layer (gated DeltaNet, Mamba-2, a short-conv block) mixes tokens in
two steps: a short causal depthwise convolution of width K over per-token inputs
``[B, T, C]``, then a recurrence whose state ``[B, *S]`` is updated once per token. Its
cache is therefore the conv's last K - 1 inputs and the recurrent state(s): the same
size at any length. It returns no ``KVView``; the model calls

    layer, outputs = layer.update_state(conv_inputs, positions, conv_fn, step_fn)

* ``conv_inputs`` ``[B, T, C]``, ``positions`` ``[B, T]`` as in ``update`` (negative =
  padding; valid positions of a row are consecutive from its length, checked eagerly).
* ``conv_fn(windows)``: ``windows`` ``[B, T, C, K]`` holds, for each new token, the K
  inputs its causal conv reads (the oldest first; inputs before position 0 are zeros).
  The model applies its conv weights and whatever follows (activation, projections) and
  returns the recurrence's per-token inputs, any pytree of ``[B, T, ...]`` arrays.
* ``step_fn(states, x)``: one token's recurrence for all rows: ``states`` is the tuple of
  recurrent states ``[B, *S_i]`` (float32), ``x`` the pytree above at one time step
  (``[B, ...]``); returns ``(states, y)``. The layer scans it over the T tokens; a padding
  token leaves its row's state unchanged. ``outputs`` are the stacked ``y`` ``[B, T, ...]``
  (zeros at padding). A layer without recurrent states (a conv block) takes
  ``step_fn=None`` and returns ``conv_fn(windows)``.

The prefill of a whole prompt and a single decode step are the same call. Like
``update_entry``, ``update_state_entry(index, ...)`` updates entry ``index`` of a stacked
layer in place, so the container stacks layers of one kind and a model scans over them.
The layer keeps the core of ``jaxkv.protocol`` (``max_length`` = None: it never fills) and
has the ``LinearState``, ``Rollback`` and ``RowSelection`` capabilities.

Rollback (speculative decoding): the reference cannot undo a recurrent state without a
recording mode. Here both halves are rings sized at construction: the conv inputs of the
last K - 1 + R positions (slot ``p % (K - 1 + R)`` holds position p) and the recurrent
states after each of the last R + 1 tokens (slot ``p % (R + 1)`` holds the state after
position p). Undoing n <= R tokens only moves ``lengths`` back; the next update reads the
conv inputs and the state the shorter row had, so re-feeding equals never having fed
the undone tokens. ``max_rollback`` is R (``rollback_slots``), and rollbacks without a
feed in between share those R steps (``rollback_budget``, per row); eagerly more is an
error naming the fix, under jit the count is clamped to what the row has left (the
container clamps every layer alike, so all stay in step). R = 0 costs nothing extra.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.batch import PackedBatch, PackedState
from jaxkv.protocol import BatchMajorLayer, CacheLayer, ChunkLimit, Growth, LinearState, Overflow, PackedRowsLayer
from jaxkv.protocol import Rollback, check_array, check_positions, describe_extent, entry, has, lengths_after
from jaxkv.protocol import limit_rollback, pytree_class
from jaxkv.sharding import BATCH, STATE, Axes


def check_state_inputs(layer, index, conv_inputs: jax.Array, positions) -> jax.Array:
    """Shape, dtype and (eagerly) position checks for ``update_state_entry``; returns
    positions as int32. ``layer`` is a stacked ``LinearAttentionLayer``."""
    caller = f"{type(layer).__name__}.update_state"
    expected = (layer.lengths.shape[1], None, layer.conv_inputs.shape[2])
    check_array(caller, "conv_inputs", conv_inputs, ("B", "T", "C"), expected, layer.conv_inputs.dtype)
    return check_positions(caller, positions, conv_inputs.shape[:2], layer.lengths, index)


def conv_windows(ring: jax.Array, old_lengths: jax.Array, conv_inputs: jax.Array, positions: jax.Array, width: int):
    """The K = ``width`` inputs each new token's causal conv reads: ``[B, T, C, K]``.

    ``ring`` ``[B, C, N]`` holds the input at position p in slot ``p % N`` for the row's
    last N positions before ``old_lengths`` ``[B]``; ``conv_inputs`` ``[B, T, C]`` are the
    new tokens at ``positions`` ``[B, T]``. Inputs are found by position, not by index,
    so padding anywhere in the T tokens never enters a window; positions before 0, and
    every tap of a padding token, read zeros.
    """
    batch, length, _ = conv_inputs.shape
    num_slots = ring.shape[-1]
    valid = positions >= 0
    # order[b, j]: index among the T new tokens of row b's j-th valid token.
    rank = jnp.cumsum(valid, axis=1) - 1
    rows = jnp.arange(batch)[:, None]
    order = (
        jnp.zeros((batch, length), jnp.int32)
        .at[rows, jnp.where(valid, rank, length)]
        .set(jnp.arange(length, dtype=jnp.int32)[None, :], mode="drop")
    )
    taps = positions[:, :, None] - (width - 1) + jnp.arange(width)[None, None, :]  # [B, T, K]
    stored = taps < old_lengths[:, None, None]
    new_index = jnp.take_along_axis(
        order, jnp.clip(taps - old_lengths[:, None, None], 0, length - 1).reshape(batch, -1), axis=1
    ).reshape(taps.shape)
    # Source: the ring's N slots, then the T new tokens; index N + t is new token t.
    source = jnp.concatenate([jnp.swapaxes(ring, 1, 2), conv_inputs], axis=1)  # [B, N + T, C]
    index = jnp.where(stored, taps % max(num_slots, 1), num_slots + new_index)
    windows = jnp.take_along_axis(source, index.reshape(batch, -1, 1), axis=1).reshape(*taps.shape, -1)
    real = (taps >= 0) & valid[:, :, None]
    return jnp.where(real[..., None], windows, 0).transpose(0, 1, 3, 2)


def rows_where(condition: jax.Array, x: jax.Array, y) -> jax.Array:
    """``where`` of a per-row ``condition`` ``[B]`` over ``x`` ``[B, ...]``."""
    return jnp.where(condition.reshape(-1, *[1] * (x.ndim - 1)), x, y)


def states_at(rings: tuple, lengths: jax.Array) -> tuple[jax.Array, ...]:
    """Each ring's ``[B, R+1, *S]`` state after position ``lengths - 1`` ``[B]``: ``[B, *S]``,
    zeros for an empty row (a ring slot may still hold a rolled-back state)."""
    rows = jnp.arange(lengths.shape[0])
    return tuple(rows_where(lengths > 0, ring[rows, (lengths - 1) % ring.shape[1]], 0.0) for ring in rings)


@pytree_class
class LinearAttentionLayer(BatchMajorLayer, Rollback, LinearState):
    """Linear-attention / SSM state: conv inputs ``[B, C_conv, K-1+R]``, states ``[B, R+1, *S]``.

    ``conv_inputs``: ring of the last K - 1 + R conv inputs (slot ``p % (K-1+R)`` holds
    position p), channel-major like the reference's conv state. ``states``: one ring per
    recurrent state, slot ``p % (R + 1)`` holding the state after position p, float32
    whatever the cache dtype (a state accumulates over the whole sequence). ``high_water``:
    the longest each row has been; slots hold positions below it, so a row can be rolled
    back to ``high_water - R`` at most (``rollback_budget``), however many rollbacks it takes.
    """

    conv_inputs: jax.Array  # [B, C, K - 1 + R]
    states: tuple  # each [B, R + 1, *S_i] float32
    lengths: jax.Array  # [B] int32: tokens seen
    high_water: jax.Array  # [B] int32: the most tokens the row has held
    conv_width: int = struct.field(pytree_node=False)
    rollback_slots: int = struct.field(pytree_node=False, default=0)

    MEMORY_FORMULA = "B·C_conv·(K-1+R)·bytes + 4·B·(R+1)·ΣS + 8·B"

    @classmethod
    def create(
        cls,
        batch_size: int,
        conv_channels: int,
        conv_width: int,
        state_shapes: tuple[tuple[int, ...], ...] = (),
        dtype=jnp.float32,
        rollback_slots: int = 0,
    ) -> LinearAttentionLayer:
        """``state_shapes``: the per-row shape of each recurrent state (empty: a conv block)."""
        if conv_width < 1 or conv_channels < 1 or rollback_slots < 0:
            raise ValueError(
                f"{cls.__name__}: need conv_width >= 1, conv_channels >= 1 and rollback_slots >= 0, got "
                f"{conv_width}, {conv_channels}, {rollback_slots}"
            )
        return cls(
            conv_inputs=jnp.zeros((batch_size, conv_channels, conv_width - 1 + rollback_slots), dtype),
            states=tuple(jnp.zeros((batch_size, rollback_slots + 1, *shape), jnp.float32) for shape in state_shapes),
            lengths=jnp.zeros((batch_size,), jnp.int32),
            high_water=jnp.zeros((batch_size,), jnp.int32),
            conv_width=conv_width,
            rollback_slots=rollback_slots,
        )

    @staticmethod
    def kv_bytes(batch_size, seq_len, num_kv_heads, head_dim, dtype, conv_channels=0, conv_width=1,
                 state_shapes=(), rollback_slots=0, **_) -> int:  # fmt: skip
        """Bytes of the layer, whatever ``seq_len``: conv ring, state rings and lengths."""
        conv = batch_size * conv_channels * (conv_width - 1 + rollback_slots) * jnp.dtype(dtype).itemsize
        states = 4 * batch_size * (rollback_slots + 1) * sum(int(np.prod(s)) for s in state_shapes)
        return conv + states + 8 * batch_size

    @property
    def max_length(self) -> None:
        return None

    @property
    def max_rollback(self) -> int:
        return self.rollback_slots

    @property
    def rollback_budget(self) -> jax.Array:
        """``[B]`` (``[L, B]`` stacked): tokens each row can still undo. Rollbacks without a
        feed in between share the R recorded steps, so this is R minus what was undone
        since the row's longest length."""
        return self.rollback_slots - (self.high_water - self.lengths)

    def describe(self) -> str:
        return describe_extent(self.rollback_slots)

    def logical_axes(self):
        """Rows on ``batch``; conv channels, state slots and recurrent state dimensions are ``state``
        (replicated by default: a gated-DeltaNet state is small, and its heads are not the K/V heads)."""
        return self.replace(
            conv_inputs=Axes(BATCH, STATE, STATE),
            states=tuple(Axes(BATCH, *(STATE,) * (state.ndim - 1)) for state in self.states),
            lengths=Axes(BATCH),
            high_water=Axes(BATCH),
        )

    def rollback_hint(self, num_tokens: int) -> str:
        """How to build a cache that can undo ``num_tokens`` (for the rollback error)."""
        return (
            f"build the cache with rollback_slots >= {num_tokens} (a linear-attention layer keeps the states of "
            f"its last rollback_slots tokens)"
        )

    def update_state_entry(self, index, conv_inputs, positions, conv_fn: Callable, step_fn: Callable | None):
        """Feed ``conv_inputs`` ``[B, T, C]`` at ``positions`` ``[B, T]`` to entry ``index``
        of a stacked layer (leaves ``[L, ...]``), in place; returns ``(layer, outputs)``."""
        positions = check_state_inputs(self, index, conv_inputs, positions)
        old_lengths = entry(self.lengths, index)
        lengths = lengths_after(old_lengths, positions)
        ring = entry(self.conv_inputs, index)
        xs = conv_fn(conv_windows(ring, old_lengths, conv_inputs, positions, self.conv_width))

        # Keep each row's last N inputs only, so no two writes of one update share a slot.
        num_slots = ring.shape[-1]
        kept = (positions >= 0) & (positions >= lengths[:, None] - num_slots)
        slots = jnp.where(kept, positions % max(num_slots, 1), num_slots)
        rows = jnp.arange(conv_inputs.shape[0])[:, None]
        new = self.replace(
            conv_inputs=self.conv_inputs.at[index, rows, :, slots].set(conv_inputs, mode="drop"),
            lengths=self.lengths.at[index].set(lengths),
            high_water=self.high_water.at[index].max(lengths),
        )
        if step_fn is None:
            return new, xs
        rings, outputs = self._scan_states(index, old_lengths, positions, xs, step_fn)
        return new.replace(states=tuple(s.at[index].set(r) for s, r in zip(self.states, rings))), outputs

    def _scan_states(self, index, old_lengths, positions, xs, step_fn):
        """Run ``step_fn`` over the T tokens from each row's current state, recording the
        state after every real token in the rings; padding keeps the state and outputs 0."""
        num_states = self.rollback_slots + 1
        rows = jnp.arange(positions.shape[0])
        rings = tuple(entry(s, index) for s in self.states)
        current = states_at(rings, old_lengths)

        def step(carry, inputs):
            states, rings = carry
            x, position = inputs
            stepped, y = step_fn(states, x)
            real = position >= 0
            states = tuple(rows_where(real, n.astype(jnp.float32), s) for s, n in zip(states, stepped))
            slot = jnp.where(real, position % num_states, num_states)
            rings = tuple(r.at[rows, slot].set(s, mode="drop") for r, s in zip(rings, states))
            y = jax.tree.map(lambda a: rows_where(real, a, 0), y)
            return (states, rings), y

        time_major = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), (xs, positions))
        (_, rings), ys = jax.lax.scan(step, (current, rings), time_major)
        return rings, jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), ys)

    def current_states(self) -> tuple[jax.Array, ...]:
        """Each recurrent state ``[B, *S]`` after the row's last token (zeros when empty)."""
        return states_at(self.states, self.lengths)

    def reset(self):
        return jax.tree.map(jnp.zeros_like, self)


@pytree_class
class HybridLayer(BatchMajorLayer, Rollback, LinearState, Growth, Overflow, ChunkLimit):
    """A linear state and attention K/V in one layer (full, or sliding with ``hybrid_sliding``).

    ``update_state`` feeds the linear half, ``update`` / ``update_entry`` the attention
    half (a ``StaticLayer``, ``DynamicLayer`` or ``SlidingWindowLayer``); a forward calls
    both with the same positions. ``lengths`` reads the linear half; rollback, reset and
    row gathers act on both, and ``max_rollback`` is the smaller budget of the two. Growth,
    overflow and a chunk limit are the attention half's, if it has them.
    """

    linear: LinearAttentionLayer
    attention: CacheLayer  # a K/V layer with Rollback

    @property
    def lengths(self) -> jax.Array:
        return self.linear.lengths

    @property
    def max_length(self) -> int | None:
        return self.attention.max_length

    @property
    def max_rollback(self) -> int:
        budgets = [b for b in (self.linear.max_rollback, self.attention.max_rollback) if b is not None]
        return min(budgets)

    @property
    def overflowed(self) -> jax.Array:
        return self.attention.overflowed if has(self.attention, Overflow) else jnp.zeros(self.lengths.shape, bool)

    def exact_chunk_lengths(self) -> jax.Array | None:
        return self.attention.exact_chunk_lengths() if has(self.attention, ChunkLimit) else None

    def rollback_hint(self, num_tokens: int) -> str:
        return self.linear.rollback_hint(num_tokens)

    @property
    def rollback_budget(self) -> jax.Array:
        """Each row's smaller budget of the two halves (a ring's counts R + 1, the linear state's R)."""
        attention = self.attention.rollback_budget
        return self.linear.rollback_budget if attention is None else jnp.minimum(self.linear.rollback_budget, attention)

    def update_entry(self, index, keys, values, positions):
        attention, view = self.attention.update_entry(index, keys, values, positions)
        return self.replace(attention=attention), view

    def update_state_entry(self, index, conv_inputs, positions, conv_fn, step_fn):
        linear, outputs = self.linear.update_state_entry(index, conv_inputs, positions, conv_fn, step_fn)
        return self.replace(linear=linear), outputs

    def grow(self, capacity: int) -> HybridLayer:
        """Grow a growing attention half (see ``DynamicLayer.grow``); others are unchanged."""
        return self.replace(attention=self.attention.grow(capacity)) if has(self.attention, Growth) else self

    def rollback(self, num_tokens):
        # Clamp to the combined budget first (eagerly: an error), so both halves stay in step.
        n = limit_rollback(self, num_tokens, self.lengths)
        return self.replace(linear=self.linear.rollback(n), attention=self.attention.rollback(n))

    def reset(self):
        return self.replace(linear=self.linear.reset(), attention=self.attention.reset())

    def logical_axes(self):
        return self.replace(linear=self.linear.logical_axes(), attention=self.attention.logical_axes())


@pytree_class
class PackedStateLayer(PackedRowsLayer, PackedState):
    """Linear-attention states in one slot per engine row, fed with packed tokens of many rows
    (``PackedRowsLayer``).

    The serving engine's paged cache keeps a model's recurrent states here, beside its K/V
    pages. ``slots``: a ``LinearAttentionLayer`` with one row per engine row: the conv inputs and
    recurrent state of the request that holds the row. The layer lays an update's packed tokens
    out ``[R, T]``, runs the conv and the recurrence there, and returns the outputs packed again.

    Rollback by position (the engine's speculative decoding): a row whose first position p in an
    update is below its length continues from the state after position p - 1, as if the tokens
    from p on had never been fed: its length moves back to p (``Rollback.rollback`` of the slots)
    and the rings of ``rollback_slots`` R hold what the shorter row had. A verifying step feeds a
    row its token and k <= R drafts and the next one starts after the accepted ones, so a row
    never goes back more than k. Past a row's ``rollback_budget`` (R, less what it undid since
    its longest length) it is, eagerly, an error naming the fix; under jit the rollback is
    clamped to the budget while the tokens are still laid out from p, so that row's outputs and
    state are wrong: build the cache with ``rollback_slots`` >= k.
    """

    slots: LinearAttentionLayer

    MEMORY_FORMULA = LinearAttentionLayer.MEMORY_FORMULA + "; B engine rows"
    WHY_NOT = {
        **PackedRowsLayer.WHY_NOT,
        Rollback: "it rolls back by position: a packed update whose row starts below the row's length continues "
        "from there (up to rollback_slots tokens back)",
        LinearState: "it serves the engine's packed batch: Cache.update_state(..., packed=PackedBatch)",
    }
    kv_bytes = staticmethod(LinearAttentionLayer.kv_bytes)

    def update_state_packed_entry(
        self, index, conv_inputs, positions, conv_fn: Callable, step_fn: Callable | None, packed: PackedBatch
    ):
        """Feed packed ``conv_inputs`` ``[1, N, C]`` at ``positions`` ``[1, N]``; ``conv_fn`` sees packed
        windows ``[1, N, C, K]`` and outputs come back packed ``[1, N, ...]`` (zeros at padding)."""
        slots, packing = self.packing(index, positions[0], packed)

        def packed_conv(windows):  # the model's conv_fn on packed windows, its outputs unpacked
            packed = jax.tree.map(lambda a: packing.packed(a)[None], windows)
            return jax.tree.map(lambda a: packing.unpacked(a[0], 0), conv_fn(packed))

        slots, outputs = slots.update_state_entry(
            index, packing.unpacked(conv_inputs[0], 0), packing.unpacked(positions[0], -1), packed_conv, step_fn
        )
        return self.replace(slots=slots), jax.tree.map(lambda a: packing.packed(a)[None], outputs)

    def _started(self, current: LinearAttentionLayer, starts: jax.Array) -> LinearAttentionLayer:
        """Rows starting at 0 emptied, rows starting at p below their length rolled back to p
        (``starts`` ``[R]``, -1 for a row without tokens; see the class docstring)."""
        current = super()._started(current, starts)
        return current.rollback(jnp.where(starts > 0, jnp.maximum(current.lengths - starts, 0), 0))
