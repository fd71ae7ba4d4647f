"""How fast can XLA's CPU backend read bfloat16 weights in a one-row decode step?

30 scanned one-row products with ``[1536, 576]`` matrices, stored ``[out, in]`` as the models
store them (SmolLM2's MLP shapes), each form widening bf16 to float32 in its own way. Prints a
table: median ms per call over 20 calls after a warm-up, and the GB/s of bytes stored.

    .venv/bin/python scripts/bench_bf16_widening.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from jax import lax

LAYERS, OUT, IN = 30, 1536, 576
F32 = jnp.float32


def shift_widened(w: jax.Array) -> jax.Array:
    """bf16 -> float32 exactly, as the 16-bit shift of its bits (XLA rewrites it to a convert)."""
    return lax.bitcast_convert_type(lax.bitcast_convert_type(w, jnp.uint16).astype(jnp.uint32) << 16, F32)


def packed(w16: jax.Array) -> jax.Array:
    """Two bf16 per uint32 word ``[..., out, in / 2]``: column j low, column j + in/2 high."""
    bits = lax.bitcast_convert_type(w16, jnp.uint16).astype(jnp.uint32)
    return bits[..., : IN // 2] | (bits[..., IN // 2 :] << 16)


def packed_product(h: jax.Array, words: jax.Array) -> jax.Array:
    """``h @ w.T`` of a packed matrix: two half products, kept apart by a barrier so that XLA
    fuses each half's widening into its own matrix-vector loop."""
    low = lax.bitcast_convert_type(words << 16, F32)
    high = lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), F32)
    first, second = lax.optimization_barrier((h[:, : IN // 2] @ low.T, h[:, IN // 2 :] @ high.T))
    return first + second


PRODUCTS = {
    "float32": lambda h, w: h @ w.T,
    "bf16 dot": lambda h, w: (h.astype(jnp.bfloat16) @ w.T).astype(F32),
    "bf16 astype(float32)": lambda h, w: h @ w.astype(F32).T,
    "bf16 16-bit shift": lambda h, w: h @ shift_widened(w).T,
    "packed uint32, barrier": packed_product,
}


def decode_like(product, weights: jax.Array, x: jax.Array) -> jax.Array:
    def layer(h, w):
        return h + 1e-3 * product(h, w)[:, :IN], None

    return lax.scan(layer, x, weights)[0].sum()


def median_seconds(fn, *args, calls: int = 20) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2]


def main() -> None:
    key = jax.random.key(0)
    w32 = jax.random.normal(key, (LAYERS, OUT, IN), F32)
    w16 = w32.astype(jnp.bfloat16)
    stored = {"float32": w32, "packed uint32, barrier": packed(w16)}
    x = jax.random.normal(key, (1, IN), F32)
    print("| weights | ms per step | GB/s of stored bytes | result |")
    print("|---|---:|---:|---:|")
    for name, product in PRODUCTS.items():
        weights = stored.get(name, w16)
        fn = jax.jit(lambda w, x, product=product: decode_like(product, w, x))
        seconds = median_seconds(fn, weights, x)
        gbs = weights.size * weights.dtype.itemsize / seconds / 1e9
        print(f"| {name} | {seconds * 1e3:.2f} | {gbs:.1f} | {float(fn(weights, x)):.4f} |")


if __name__ == "__main__":
    main()
