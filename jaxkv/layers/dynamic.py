"""Full attention in a buffer that grows with the sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.protocol import Growth, PositionalLayer, Refill, Rollback, check_update_inputs, is_traced, pytree_class
from jaxkv.sharding import to_host
from jaxkv.sizing import bucket


@pytree_class
class DynamicLayer(PositionalLayer, Rollback, Growth, Refill):
    """K/V for full attention in a buffer ``[B, H_kv, N, D]`` whose capacity N grows.

    Eagerly, ``update`` grows the buffer to exactly what the rows need, which is the
    reference's concatenation. Under ``jit`` a shape is fixed for the whole trace, so the
    buffer cannot grow there: call ``reserve(T)`` (or ``Cache.reserve``) outside the
    jitted step before feeding T tokens. It grows the capacity to the next power of two,
    so a loop of n single-token steps meets O(log n) distinct shapes and traces. A traced
    write that still runs past the capacity behaves like ``StaticLayer``'s: dropped,
    counted in ``lengths``, reported by ``overflowed``.
    """

    keys: jax.Array  # [B, H_kv, N, D]
    values: jax.Array  # [B, H_kv, N, D]
    lengths: jax.Array  # [B] int32

    MEMORY_FORMULA = "2·B·bucket(S)·H_kv·D·bytes + 4·B, bucket = next power of 2 (eager: exactly S)"

    @classmethod
    def create(cls, batch_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32, capacity: int = 0):
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch_size,), jnp.int32))

    @staticmethod
    def kv_bytes(batch_size, seq_len, num_kv_heads, head_dim, dtype, **_) -> int:
        """K/V bytes once ``seq_len`` tokens were reserved in buckets."""
        return 2 * batch_size * bucket(seq_len) * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize + 4 * batch_size

    @property
    def max_length(self) -> None:
        return None

    def grow(self, capacity: int) -> DynamicLayer:
        """The same layer (or stack of layers) with room for ``capacity`` tokens; never shrinks."""
        extra = capacity - self.capacity
        if extra <= 0:
            return self
        pad = [(0, 0)] * (self.keys.ndim - 2) + [(0, extra), (0, 0)]
        return self.replace(keys=jnp.pad(self.keys, pad), values=jnp.pad(self.values, pad))

    def reserve(self, num_new_tokens: int) -> DynamicLayer:
        """Grow (outside jit) so every row can take ``num_new_tokens`` more tokens."""
        if is_traced(self.lengths):
            raise RuntimeError(
                "DynamicLayer.reserve reads the row lengths and must run outside jit; "
                "call it on the cache before the jitted step"
            )
        needed = int(np.max(to_host(self.lengths), initial=0)) + int(num_new_tokens)
        return self if needed <= self.capacity else self.grow(bucket(needed))

    def update_entry(self, index, keys, values, positions):
        positions = check_update_inputs(self, index, keys, values, positions)
        layer = self
        if is_traced(positions, index):
            if positions.shape[1] > self.capacity:
                raise ValueError(
                    f"DynamicLayer.update under jit: {positions.shape[1]} new tokens exceed the "
                    f"capacity {self.capacity}; call cache.reserve({positions.shape[1]}) before the jitted step"
                )
        else:
            layer = self.grow(int(np.max(np.asarray(positions), initial=-1)) + 1)
        return layer.write(index, keys, values, positions)
