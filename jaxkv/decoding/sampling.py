"""Choosing the next token from logits: greedy, or temperature then top-k, top-p and min-p."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP_K = 2**31 - 1  # top-k is an int32 on the device; any k past the vocabulary keeps every token


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature == 0``; otherwise temperature, then top-k, top-p, min-p."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        reals = (self.temperature, self.top_p, self.min_p)
        if not all(isinstance(x, numbers.Real) and math.isfinite(x) for x in reals):
            raise ValueError(f"invalid sampling {self}: temperature, top_p and min_p must be finite numbers")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int | np.integer):
            raise TypeError(f"invalid sampling {self}: top_k must be an int")
        if (
            self.temperature < 0
            or not 0 <= self.top_k <= MAX_TOP_K
            or not 0 < self.top_p <= 1
            or not 0 <= self.min_p <= 1
        ):
            raise ValueError(
                f"invalid sampling {self}: need temperature >= 0, 0 <= top_k <= {MAX_TOP_K}, 0 < top_p <= 1, "
                "0 <= min_p <= 1"
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
        kth = jax.lax.top_k(logits, min(sampling.top_k, logits.shape[-1]))[0][:, -1:]
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


class RowSampling(NamedTuple):
    """Per-row sampling parameters ``[R]`` (a serving step's rows each follow their own
    request): ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 keep every token."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array

    @classmethod
    def stack(cls, rows: Sequence[Sampling]) -> RowSampling:
        """The parameters of ``rows`` as host arrays ``[R]``."""
        return cls(
            np.array([s.temperature for s in rows], np.float32),
            np.array([s.top_k for s in rows], np.int32),
            np.array([s.top_p for s in rows], np.float32),
            np.array([s.min_p for s in rows], np.float32),
        )


def sample_rows(logits: jax.Array, keys: jax.Array, params: RowSampling) -> jax.Array:
    """Next tokens ``[R]`` from ``logits`` ``[R, V]`` (float32), row r drawn with ``keys[r]`` under
    its own parameters, with ``sampling_logits``' rules (temperature, then top-k, top-p, min-p).

    Rows with temperature 0 take the argmax. The vocabulary is sorted only when some row
    asks for top-k or top-p, and nothing is drawn when every row is greedy."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw():
        return jax.vmap(jax.random.categorical)(keys, row_logits(logits, params)).astype(jnp.int32)

    sampled = jax.lax.cond(jnp.any(params.temperature > 0), draw, lambda: greedy)
    return jnp.where(params.temperature > 0, sampled, greedy)


def row_logits(logits: jax.Array, params: RowSampling) -> jax.Array:
    """``logits`` ``[R, V]`` as row r's sampling draws from them: divided by its temperature (1 for
    a greedy row), then its top-k, top-p and min-p (dropped tokens at -inf)."""
    scaled = logits / jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    needs_sort = jnp.any((params.top_k > 0) | (params.top_p < 1))
    scaled = jax.lax.cond(needs_sort, lambda: top_k_top_p(scaled, params.top_k, params.top_p), lambda: scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    return jnp.where(probs < params.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True), -jnp.inf, scaled)


def top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``logits`` ``[R, V]`` with tokens outside each row's ``top_k`` (0: all) and then outside the
    smallest set of top tokens reaching probability ``top_p`` set to -inf, in one sort."""
    order = jnp.argsort(-logits, axis=-1)
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    rank = jnp.arange(logits.shape[-1])[None, :]
    ranked = jnp.where((top_k[:, None] > 0) & (rank >= top_k[:, None]), -jnp.inf, ranked)
    probs = jax.nn.softmax(ranked, axis=-1)
    ranked = jnp.where(jnp.cumsum(probs, axis=-1) - probs >= top_p[:, None], -jnp.inf, ranked)
    return jnp.zeros_like(logits).at[jnp.arange(logits.shape[0])[:, None], order].set(ranked)
