"""Choosing the next token from logits: greedy, or temperature then top-k, top-p and min-p."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature == 0``; otherwise temperature, then top-k, top-p, min-p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ValueError(
                f"invalid sampling {self}: need temperature >= 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1"
            )


GREEDY = Sampling()


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens ``[B]`` from ``logits`` ``[B, V]`` (float32)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, sampling_logits(logits, sampling), axis=-1).astype(jnp.int32)


def sampling_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """``logits`` ``[B, V]`` after temperature, top-k, top-p and min-p (dropped tokens -inf):
    ``sample`` draws from their softmax (``temperature > 0``)."""
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        # Keep the smallest set of top tokens whose probability reaches top_p.
        order = jnp.argsort(-logits, axis=-1)
        sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        drop_sorted = before >= sampling.top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    if sampling.min_p:
        probs = jax.nn.softmax(logits, axis=-1)
        logits = jnp.where(probs < sampling.min_p * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, logits)
    return logits
