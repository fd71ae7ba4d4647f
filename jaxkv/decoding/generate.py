"""Plain decoding: after the driver's prefill (``jaxkv.decoding.driver``), one compiled
``lax.while_loop`` draws one token per row per step.

The cache is donated to the loop and travels in its carry (``DecodeCarry``), so every step
updates it in place. Rows are independent: prompts of different lengths are right-padded,
each row stops on its own stop token, at ``max_new_tokens``, or when its cache is full
(finish reason ``CAPACITY``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.decoding.driver import Loop, Prefilled, Request, Strategy, drive, emit, prefill_batch, prepare_batch
from jaxkv.decoding.model import DecoderModel
from jaxkv.decoding.sampling import sample
from jaxkv.protocol import pytree_class
from jaxkv.sharding import to_host
from jaxkv.sizing import bucket


class Finish(enum.IntEnum):
    """Why a row stopped."""

    RUNNING = 0
    STOP_TOKEN = 1
    MAX_NEW_TOKENS = 2
    CAPACITY = 3


class Limits(NamedTuple):
    """When a row stops: on one of ``stop_tokens`` ``[N]``, after ``max_new_tokens``, or
    when the cache's ``capacity`` (None: unbounded) cannot take its next token."""

    stop_tokens: jax.Array
    max_new_tokens: int | jax.Array
    capacity: int | None

    def finish(self, token: jax.Array, num_generated, cache_lengths: jax.Array) -> jax.Array:
        """``[B]`` ``Finish`` of rows whose latest token is ``token`` ``[B]``, with
        ``num_generated`` tokens generated and ``cache_lengths`` ``[B]`` tokens in the cache
        (the latest not yet fed)."""
        reason = jnp.where(jnp.isin(token, self.stop_tokens), Finish.STOP_TOKEN, Finish.RUNNING)
        reason = jnp.where((reason == 0) & (num_generated >= self.max_new_tokens), Finish.MAX_NEW_TOKENS, reason)
        if self.capacity is not None:  # the next token would not fit
            reason = jnp.where((reason == 0) & (cache_lengths >= self.capacity), Finish.CAPACITY, reason)
        return reason


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
    cache: object = None  # the Cache after decoding (see ``generate``)

    def row(self, i: int) -> list[int]:
        return self.tokens[i, : self.num_generated[i]].tolist()


@pytree_class
class DecodeCarry:
    """The decode loop between steps."""

    cache: Any
    tokens: jax.Array  # [B, max_new_tokens] int32: generated so far, -1 where none (yet)
    latest: jax.Array  # [B] int32: each row's newest token, not in the cache yet
    step: jax.Array  # int32: tokens generated per running row
    finish: jax.Array  # [B] int32 Finish
    key: jax.Array


@functools.partial(
    jax.jit, static_argnames=("graphdef", "sampling", "token_slots", "stream"), donate_argnames=("cache",)
)
def decode(
    graphdef, state, cache, first_logits, key, stop_tokens, max_new_tokens, *, sampling, token_slots, stream=None
):
    """Draw each row's first token from ``first_logits`` ``[B, V]``, then decode until every
    row has stopped; returns the final ``DecodeCarry``, its ``tokens`` ``[B, token_slots]``.

    ``max_new_tokens`` is traced and ``token_slots`` (at least it) a bucket, so runs asking
    for different numbers of tokens share one executable (an experiment's tasks answer in 8
    and 10 tokens). A stopped row feeds padding (position -1), so its cache no longer
    changes. ``stream``, if given, is called on the host with each step's tokens ``[B]``
    (-1 for stopped rows).
    """
    model = nnx.merge(graphdef, state)
    limits = Limits(stop_tokens, max_new_tokens, cache.max_length)
    first_key, key = jax.random.split(key)
    first = sample(first_logits, first_key, sampling)
    emit(stream, first)
    tokens = jnp.full((first.shape[0], token_slots), -1, jnp.int32).at[:, 0].set(first)
    carry = DecodeCarry(cache, tokens, first, jnp.int32(1), limits.finish(first, 1, cache.lengths), key)

    def step(carry: DecodeCarry) -> DecodeCarry:
        running = carry.finish == Finish.RUNNING
        positions = jnp.where(running, carry.cache.lengths, -1)[:, None]
        logits, cache = model(carry.latest[:, None], positions, carry.cache)
        key, step_key = jax.random.split(carry.key)
        token = jnp.where(running, sample(logits[:, -1], step_key, sampling), -1)
        emit(stream, token)
        finish = jnp.where(running, limits.finish(token, carry.step + 1, cache.lengths), carry.finish)
        return DecodeCarry(cache, carry.tokens.at[:, carry.step].set(token), token, carry.step + 1, finish, key)

    return jax.lax.while_loop(lambda carry: jnp.any(carry.finish == Finish.RUNNING), step, carry)


@dataclasses.dataclass(frozen=True)
class PlainDecoding(Strategy):
    """``generate``'s strategy: sample (or take the argmax of) one token per row per step."""

    request: Request

    def loop(self, run: Prefilled, started: None) -> Loop:
        request = self.request
        static = {"sampling": request.sampling, "token_slots": bucket(request.max_new_tokens), "stream": request.stream}
        limit = jnp.int32(request.max_new_tokens)
        return Loop(decode, static, (run.state, run.cache, run.logits, request.key, request.stop_array, limit))

    def result(self, carry: DecodeCarry, run: Prefilled) -> Generation:
        tokens = to_host(carry.tokens)[:, : self.request.max_new_tokens]
        finish = [Finish(int(r)) for r in to_host(carry.finish)]
        num_generated = np.sum(tokens >= 0, axis=1).astype(np.int32)
        timings = run.timings
        return Generation(
            tokens, num_generated, finish, timings.prefill_seconds, timings.loop_seconds, timings.compile_seconds,
            carry.cache.nbytes, carry.cache,
        )  # fmt: skip


def generate(model: DecoderModel, prompts: Sequence[Sequence[int]], **options) -> Generation:
    """Generate up to ``max_new_tokens`` for each prompt (token ids) in one batch.

    ``options``: the keywords of ``jaxkv.decoding.driver.Request.create`` (``max_new_tokens``,
    ``stop_tokens``, ``sampling``, ``seed``, ``stream``, ``encoder_inputs``, ``cache``,
    ``full_attention``, ``max_length`` and the model's cache settings). Encoder-decoder
    models (``EncoderDecoderModel``) take ``encoder_inputs``, one token sequence per prompt,
    encoded into the cache once before the prefill.

    ``cache``: continue from it (a shared prefix is left intact: it is not donated).
    ``stream(tokens [B])`` receives each step's tokens. The returned ``Generation.cache``
    holds each prompt and its generated tokens except the last one (sampled, not yet fed):
    feed that token first to continue the conversation (``Session`` does).
    """
    return drive(model, prompts, PlainDecoding(Request.create(**options)))


def prefill_prefix(
    model: DecoderModel, prefixes: Sequence[Sequence[int]], *, max_length: int, chunk: int | None = None,
    **cache_options,
):  # fmt: skip
    """A cache holding ``prefixes`` (token ids, one row each): a shared system prompt or
    few-shot examples prefilled once, then continued by any number of requests with
    ``generate(..., cache=prefix_cache)``, which never modifies it (caches are immutable,
    so sharing needs no copy). ``max_length`` must fit a prefix plus what follows it;
    ``cache_options``: ``full_attention`` and the model's cache settings. ``chunk``: prefill
    ``chunk`` tokens per update, each continuing the cache the last left (the last update of a
    row takes the rest, at least ``chunk`` tokens): one update's cache within float rounding,
    without attending every prefix token at once (None: one update)."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"prefill_prefix: chunk must be a positive number of tokens, got {chunk}")
    shortest = min(map(len, prefixes)) if prefixes else 0
    starts = [0] if chunk is None else list(range(0, max(1, shortest - chunk), chunk))
    ends = [*starts[1:], None]
    request = Request.create(max_new_tokens=1, max_length=max_length, **cache_options)
    first = [prefix[: ends[0]] for prefix in prefixes]
    cache = prefill_batch(model, prepare_batch(model, first, request)).cache
    for start, end in zip(starts[1:], ends[1:], strict=True):
        cache = generate(model, [prefix[start:end] for prefix in prefixes], max_new_tokens=1, cache=cache).cache
    return cache
