"""Full attention over a preallocated buffer: slot ``p`` holds the token at position ``p``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.kernels import XLA
from jaxkv.sharding import Layout
from jaxkv.protocol import PositionalLayer, Refill, Rollback, check_capacity, check_update_inputs, pytree_class


@pytree_class
class StaticLayer(PositionalLayer, Rollback, Refill):
    """K/V for full attention in a fixed buffer ``[B, H_kv, S_max, D]``.

    Attention sees the whole buffer; ``kv_positions`` hides slots not yet written. The
    shape never changes, so one compiled step serves every length.

    Overflow: a write past ``S_max`` raises where it is known (T > S_max at trace time,
    or eagerly with concrete positions). Under ``jit`` the tokens past ``S_max`` are
    dropped (never clamped onto live slots), ``lengths`` still counts them, and
    ``Cache.overflowed`` reports the row; attention for those queries then misses their
    own and later keys, so generation stops such rows.
    """

    keys: jax.Array  # [B, H_kv, S_max, D]
    values: jax.Array  # [B, H_kv, S_max, D]
    lengths: jax.Array  # [B] int32
    # See PositionalLayer; keyword-only, so that subclasses may add fields without defaults.
    attention_backend: str = struct.field(pytree_node=False, default=XLA, kw_only=True)
    sharding: Layout | None = struct.field(pytree_node=False, default=None, kw_only=True)

    MEMORY_FORMULA = "2·B·S_max·H_kv·D·bytes + 4·B"

    @classmethod
    def create(
        cls, batch_size: int, num_kv_heads: int, head_dim: int, max_length: int, dtype=jnp.float32,
        attention_backend: str = XLA, sharding: Layout | None = None,
    ):  # fmt: skip
        """``attention_backend``: a concrete one (``jaxkv.kernels.resolve_backend`` resolves 'auto');
        ``sharding``: the mesh and rules the cache is sharded by (its kernels run per device)."""
        if max_length <= 0:
            raise ValueError(f"StaticLayer: max_length must be positive, got {max_length}")
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        return cls(
            jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch_size,), jnp.int32),
            attention_backend=attention_backend, sharding=sharding,
        )

    @staticmethod
    def kv_bytes(batch_size, seq_len, num_kv_heads, head_dim, dtype, max_length=None, **_) -> int:
        """K/V bytes for a cache preallocated to ``max_length`` (default: ``seq_len``)."""
        slots = max_length or seq_len
        return 2 * batch_size * slots * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize + 4 * batch_size

    @property
    def max_length(self) -> int:
        return self.capacity

    def update_entry(self, index, keys, values, positions):
        positions = check_update_inputs(self, index, keys, values, positions)
        check_capacity(self, positions, self.capacity)
        return self.write(index, keys, values, positions)
