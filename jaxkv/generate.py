"""Jitted generation: a bucketed prefill, then one compiled ``lax.while_loop`` decode.

The cache is donated to both compiled functions and travels in the loop carry, so every
step updates it in place. Any model works that is an ``nnx.Module`` called as
``logits, cache = model(tokens [B, T], positions [B, T], cache, logits_index=None)`` and
has ``init_cache(batch_size, max_length, **cache_kwargs)``.

Rows are independent: prompts of different lengths are right-padded (padding positions
are -1, so they are neither stored nor attended), each row stops on its own stop token,
at ``max_new_tokens``, or when its cache is full (finish reason ``CAPACITY``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from jaxkv.dynamic import bucket


class Finish(enum.IntEnum):
    """Why a row stopped."""

    RUNNING = 0
    STOP_TOKEN = 1
    MAX_NEW_TOKENS = 2
    CAPACITY = 3


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


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens ``[B]`` from ``logits`` ``[B, V]`` (float32)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
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
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@dataclasses.dataclass
class Generation:
    """``tokens`` ``[B, max_new_tokens]`` (-1 after a row stopped), per-row counts and reasons."""

    tokens: np.ndarray
    num_generated: np.ndarray
    finish: list[Finish]
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    cache_bytes: int

    def row(self, i: int) -> list[int]:
        return self.tokens[i, : self.num_generated[i]].tolist()


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling"), donate_argnames=("cache",))
def prefill(graphdef, state, cache, tokens, prompt_lengths, key, *, sampling: Sampling):
    """Feed the right-padded prompts ``[B, T]``; return each row's first new token and the cache."""
    model = nnx.merge(graphdef, state)
    positions = cache.next_positions(tokens.shape[1], num_new=prompt_lengths)
    logits, cache = model(tokens, positions, cache, logits_index=prompt_lengths - 1)
    return sample(logits[:, 0], key, sampling), cache


@functools.partial(
    jax.jit, static_argnames=("graphdef", "sampling", "max_new_tokens", "stream"), donate_argnames=("cache",)
)
def decode(graphdef, state, cache, first_token, key, stop_tokens, *, sampling, max_new_tokens, stream=None):
    """Decode until every row has stopped; ``first_token`` ``[B]`` is already generated.

    One ``lax.while_loop``: the cache is in the carry. A stopped row feeds padding
    (position -1), so its cache no longer changes. ``stream``, if given, is called on the
    host with each step's tokens ``[B]`` (-1 for stopped rows) through ``io_callback``.
    """
    model = nnx.merge(graphdef, state)
    batch = first_token.shape[0]
    capacity = cache.max_length
    out = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first_token)

    def finish_reason(token, count, lengths):
        reason = jnp.where(jnp.isin(token, stop_tokens), Finish.STOP_TOKEN, Finish.RUNNING)
        reason = jnp.where((reason == 0) & (count >= max_new_tokens), Finish.MAX_NEW_TOKENS, reason)
        if capacity is not None:  # the next token would not fit
            reason = jnp.where((reason == 0) & (lengths >= capacity), Finish.CAPACITY, reason)
        return reason

    def emit(token, reason):
        if stream is not None:
            io_callback(stream, None, token, ordered=True)
        return reason

    reason = emit(first_token, finish_reason(first_token, 1, cache.lengths))

    def cond(carry):
        return jnp.any(carry[4] == Finish.RUNNING)

    def body(carry):
        cache, out, token, step, reason, key = carry
        running = reason == Finish.RUNNING
        positions = jnp.where(running, cache.lengths, -1)[:, None]
        logits, cache = model(token[:, None], positions, cache)
        key, step_key = jax.random.split(key)
        token = jnp.where(running, sample(logits[:, -1], step_key, sampling), -1)
        out = out.at[:, step].set(token)
        new_reason = finish_reason(token, step + 1, cache.lengths)
        reason = emit(token, jnp.where(running, new_reason, reason))
        return cache, out, token, step + 1, reason, key

    carry = (cache, out, first_token, jnp.int32(1), reason, key)
    cache, out, _, _, reason, _ = jax.lax.while_loop(cond, body, carry)
    return out, reason, cache


_COMPILED: dict = {}


def compiled(fn, static: dict, *args):
    """``fn`` lowered and compiled for these argument shapes, reused across calls.

    Returns the executable and the seconds spent compiling now (0 when reused). Prompt
    lengths are bucketed, so a new prompt of a seen bucket compiles nothing.
    """
    leaves, treedef = jax.tree.flatten(args)
    key = (fn, treedef, tuple((x.shape, x.dtype) for x in leaves), tuple(sorted(static.items())))
    if key in _COMPILED:
        return _COMPILED[key], 0.0
    start = time.perf_counter()
    _COMPILED[key] = fn.lower(*args, **static).compile()
    return _COMPILED[key], time.perf_counter() - start


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_tokens: Sequence[int] = (),
    sampling: Sampling = Sampling(),
    seed: int = 0,
    cache_kind: str = "static",
    max_length: int | None = None,
    stream: Callable[[np.ndarray], None] | None = None,
    **cache_kwargs,
) -> Generation:
    """Generate up to ``max_new_tokens`` for each prompt (token ids) in one batch.

    Prompt lengths are padded to a power-of-two bucket and the static cache capacity is
    ``max_length`` (default: the bucket plus ``max_new_tokens``, rounded up to a bucket),
    so new prompt lengths reuse compiled code. A prompt that cannot fit is refused here,
    before anything compiles. ``stream(tokens [B])`` receives each step's tokens.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = bucket(int(lengths.max()))
    if max_length is None:
        max_length = bucket(width + max_new_tokens)
    limit = getattr(model.config, "max_position_embeddings", None)
    if lengths.max() >= max_length or (limit is not None and lengths.max() >= limit):
        raise ValueError(
            f"a prompt of {lengths.max()} tokens cannot fit: the cache holds {max_length} tokens and the model "
            f"{limit} positions; shorten the prompt or raise max_length"
        )
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt

    cache = model.init_cache(len(prompts), max_length, full_attention=cache_kind, **cache_kwargs)
    if cache_kind == "dynamic":
        cache = cache.reserve(width + max_new_tokens)
    graphdef, state = nnx.split(model)
    key_prefill, key_decode = jax.random.split(jax.random.key(seed))
    stop = jnp.asarray(list(stop_tokens) or [-2], jnp.int32)

    prefill_c, prefill_compile = compiled(
        prefill, {"sampling": sampling}, graphdef, state, cache, tokens, lengths, key_prefill
    )
    start = time.perf_counter()
    first, cache = prefill_c(state, cache, tokens, lengths, key_prefill)
    first.block_until_ready()
    prefill_seconds = time.perf_counter() - start

    decode_static = {"sampling": sampling, "max_new_tokens": max_new_tokens, "stream": stream}
    decode_c, decode_compile = compiled(decode, decode_static, graphdef, state, cache, first, key_decode, stop)
    start = time.perf_counter()
    out, reason, cache = decode_c(state, cache, first, key_decode, stop)
    out = np.asarray(out)
    decode_seconds = time.perf_counter() - start
    compile_seconds = prefill_compile + decode_compile

    finish = [Finish(int(r)) for r in np.asarray(reason)]
    generated = np.array([int(np.sum(row >= 0)) for row in out], np.int32)
    return Generation(out, generated, finish, prefill_seconds, decode_seconds, compile_seconds, cache.nbytes)
