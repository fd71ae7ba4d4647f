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

import collections
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

from jaxkv.sizing import bucket


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


def prompt_logits(model, cache, tokens, prompt_lengths):
    """Feed right-padded prompts ``[B, T]`` after what each row's cache already holds.

    Returns the logits ``[B, V]`` at each row's last prompt token and the updated cache.
    """
    positions = cache.next_positions(tokens.shape[1], num_new=prompt_lengths)
    logits, cache = model(tokens, positions, cache, logits_index=prompt_lengths - 1)
    return logits[:, 0], cache


def _prefill(graphdef, state, cache, tokens, prompt_lengths, key, *, sampling: Sampling):
    """Feed the right-padded prompts ``[B, T]``; return each row's first new token and the cache."""
    logits, cache = prompt_logits(nnx.merge(graphdef, state), cache, tokens, prompt_lengths)
    return sample(logits, key, sampling), cache


prefill = jax.jit(_prefill, static_argnames=("graphdef", "sampling"), donate_argnames=("cache",))
# The same step on a caller's cache (a shared prefix): not donated, so the caller's cache
# stays valid for further continuations; XLA copies the buffer once instead.
prefill_shared = jax.jit(_prefill, static_argnames=("graphdef", "sampling"))


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def encode(graphdef, state, cache, tokens, positions):
    """Encoder-decoder models: run the encoder on right-padded inputs ``[B, S]`` (positions
    -1 for padding) and store the cross-attention K/V it gives in the cache, once, before
    the decoder prefill."""
    return nnx.merge(graphdef, state).encode(tokens, positions, cache)


def row_finish(token, count, lengths, stop_tokens, max_new_tokens: int, capacity: int | None) -> jax.Array:
    """``[B]`` ``Finish`` of rows whose latest token is ``token`` ``[B]``, with ``count``
    generated tokens and ``lengths`` ``[B]`` tokens in the cache (the latest not yet fed)."""
    reason = jnp.where(jnp.isin(token, stop_tokens), Finish.STOP_TOKEN, Finish.RUNNING)
    reason = jnp.where((reason == 0) & (count >= max_new_tokens), Finish.MAX_NEW_TOKENS, reason)
    if capacity is not None:  # the next token would not fit
        reason = jnp.where((reason == 0) & (lengths >= capacity), Finish.CAPACITY, reason)
    return reason


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
        return row_finish(token, count, lengths, stop_tokens, max_new_tokens, capacity)

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


# Executables by function and argument shapes, least recently used first. Bounded: a
# long-lived process (a server, a test worker) seeing many shapes would otherwise keep
# every executable it ever compiled.
_COMPILED: collections.OrderedDict = collections.OrderedDict()
MAX_COMPILED = 16


def compiled(fn, static: dict, *args):
    """``fn`` lowered and compiled for these argument shapes, reused across calls.

    Returns the executable and the seconds spent compiling now (0 when reused). Prompt
    lengths are bucketed, so a new prompt of a seen bucket compiles nothing. The
    ``MAX_COMPILED`` most recently used executables are kept.
    """
    leaves, treedef = jax.tree.flatten(args)
    key = (fn, treedef, tuple((x.shape, x.dtype) for x in leaves), tuple(sorted(static.items())))
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key], 0.0
    start = time.perf_counter()
    _COMPILED[key] = fn.lower(*args, **static).compile()
    if len(_COMPILED) > MAX_COMPILED:
        _COMPILED.popitem(last=False)
    return _COMPILED[key], time.perf_counter() - start


def prepare_batch(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    cache=None,
    cache_kind: str = "static",
    max_length: int | None = None,
    **cache_kwargs,
) -> tuple[np.ndarray, np.ndarray, object]:
    """Right-padded prompt tokens ``[B, W]``, their lengths ``[B]`` and the cache to feed them into.

    ``W`` is the longest prompt rounded up to a power-of-two bucket, so new prompt lengths
    reuse compiled code. Without ``cache``, a fresh one is built (static capacity
    ``max_length``, default the bucket plus ``max_new_tokens`` rounded up to a bucket).
    With ``cache`` (a prefilled shared prefix, a previous chat turn, a loaded file), each
    prompt continues its row; a cache of one row is repeated to every prompt. A prompt
    that cannot fit is refused here, before anything compiles.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = bucket(int(lengths.max()))
    if cache is None:
        max_length = max_length or bucket(width + max_new_tokens)
        cache = model.init_cache(len(prompts), max_length, full_attention=cache_kind, **cache_kwargs)
        start = np.zeros_like(lengths)
    else:
        if max_length is not None or cache_kwargs:
            raise ValueError("pass either a cache to continue or settings to build one (max_length, ...), not both")
        if cache.batch_size == 1 < len(prompts):
            cache = cache.repeat(len(prompts))
        if cache.batch_size != len(prompts):
            raise ValueError(f"the cache has {cache.batch_size} rows for {len(prompts)} prompts; pass one row or one per prompt")
        max_length, start = cache.max_length, np.asarray(cache.lengths)
    cache = cache.reserve(width + max_new_tokens)  # grows dynamic layers only
    needed = int((start + lengths).max())
    limit = getattr(model.config, "max_position_embeddings", None)
    if (max_length is not None and needed >= max_length) or (limit is not None and needed >= limit):
        raise ValueError(
            f"a sequence of {needed} tokens (cached + prompt) cannot fit: the cache holds {max_length} tokens and "
            f"the model {limit} positions; shorten the prompt or raise max_length"
        )
    if max_length is not None:  # padding must fit the buffer too (a small cache continued)
        width = min(width, max_length)
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, lengths, cache


def pad_encoder_inputs(model: nnx.Module, encoder_inputs: Sequence[Sequence[int]], num_prompts: int):
    """Encoder inputs right-padded to a power-of-two bucket: tokens and positions ``[B, S]``
    (-1 for padding), so new input lengths reuse the compiled encode and decode."""
    if not hasattr(model, "encode"):
        raise ValueError(f"{type(model).__name__} has no encoder: pass encoder_inputs only to an encoder-decoder model")
    if len(encoder_inputs) != num_prompts or any(len(x) == 0 for x in encoder_inputs):
        raise ValueError(f"pass one non-empty encoder input per prompt: {len(encoder_inputs)} for {num_prompts} prompts")
    lengths = np.array([len(x) for x in encoder_inputs])
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and lengths.max() > limit:
        raise ValueError(f"an encoder input of {lengths.max()} tokens exceeds the model's {limit} positions; shorten it")
    width = bucket(int(lengths.max()))
    tokens, positions = np.zeros((len(lengths), width), np.int32), np.full((len(lengths), width), -1, np.int32)
    for row, inputs in enumerate(encoder_inputs):
        tokens[row, : len(inputs)], positions[row, : len(inputs)] = inputs, np.arange(len(inputs))
    return tokens, positions


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
    cache=None,
    encoder_inputs: Sequence[Sequence[int]] | None = None,
    **cache_kwargs,
) -> Generation:
    """Generate up to ``max_new_tokens`` for each prompt (token ids) in one batch.

    Encoder-decoder models (they have ``encode``) take ``encoder_inputs``, one token
    sequence per prompt; the prompts are then the decoder's (e.g. its start token). The
    jitted ``encode`` fills the cache's cross-attention half once, before the prefill.

    Prompts are padded and the cache built or continued as ``prepare_batch`` describes;
    ``cache``: continue from it (a shared prefix is left intact: it is not donated).
    ``stream(tokens [B])`` receives each step's tokens. The returned ``Generation.cache``
    holds each prompt and its generated tokens except the last one (sampled, not yet fed):
    feed that token first to continue the conversation (``Session`` does).
    """
    given_cache = cache is not None
    encoder = None if encoder_inputs is None else pad_encoder_inputs(model, encoder_inputs, len(prompts))
    if encoder is not None:
        if given_cache:
            raise ValueError("encoder_inputs need a fresh cache; a given cache already holds its encoder input")
        cache_kwargs["encoder_length"] = encoder[0].shape[1]
    elif not given_cache and hasattr(model, "encode"):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model: pass encoder_inputs, one per prompt")
    tokens, lengths, cache = prepare_batch(
        model, prompts, max_new_tokens=max_new_tokens, cache=cache, cache_kind=cache_kind, max_length=max_length,
        **cache_kwargs,
    )  # fmt: skip
    graphdef, state = nnx.split(model)
    encode_seconds = encode_compile = 0.0
    if encoder is not None:
        encode_c, encode_compile = compiled(encode, {}, graphdef, state, cache, *encoder)
        start = time.perf_counter()
        cache = jax.block_until_ready(encode_c(state, cache, *encoder))
        encode_seconds = time.perf_counter() - start
    key_prefill, key_decode = jax.random.split(jax.random.key(seed))
    stop = jnp.asarray(list(stop_tokens) or [-2], jnp.int32)

    prefill_fn = prefill_shared if given_cache else prefill
    prefill_c, prefill_compile = compiled(
        prefill_fn, {"sampling": sampling}, graphdef, state, cache, tokens, lengths, key_prefill
    )
    start = time.perf_counter()
    first, cache = prefill_c(state, cache, tokens, lengths, key_prefill)
    first.block_until_ready()
    prefill_seconds = time.perf_counter() - start + encode_seconds

    decode_static = {"sampling": sampling, "max_new_tokens": max_new_tokens, "stream": stream}
    decode_c, decode_compile = compiled(decode, decode_static, graphdef, state, cache, first, key_decode, stop)
    start = time.perf_counter()
    out, reason, cache = decode_c(state, cache, first, key_decode, stop)
    out = np.asarray(out)
    decode_seconds = time.perf_counter() - start
    compile_seconds = encode_compile + prefill_compile + decode_compile

    finish = [Finish(int(r)) for r in np.asarray(reason)]
    generated = np.array([int(np.sum(row >= 0)) for row in out], np.int32)
    return Generation(out, generated, finish, prefill_seconds, decode_seconds, compile_seconds, cache.nbytes, cache)


def prefill_prefix(
    model: nnx.Module, prefixes: Sequence[Sequence[int]], *, max_length: int, cache_kind: str = "static", **cache_kwargs
):
    """A cache holding ``prefixes`` (token ids, one row each): a shared system prompt or
    few-shot examples prefilled once, then continued by any number of requests with
    ``generate(..., cache=prefix_cache)``, which never modifies it (caches are immutable,
    so sharing needs no copy). ``max_length`` must fit a prefix plus what follows it."""
    tokens, lengths, cache = prepare_batch(
        model, prefixes, max_new_tokens=1, cache_kind=cache_kind, max_length=max_length, **cache_kwargs
    )
    graphdef, state = nnx.split(model)
    key = jax.random.key(0)
    prefill_c, _ = compiled(prefill, {"sampling": Sampling()}, graphdef, state, cache, tokens, lengths, key)
    return prefill_c(state, cache, tokens, lengths, key)[1]


class Session:
    """A conversation whose cache is kept across turns, so each turn feeds only its new tokens.

    ``reply(conversation)`` takes the whole conversation so far as token ids (e.g. the
    rendered chat template ending in the assistant's header) and generates the next answer.
    The cache holds ``self.tokens``. A turn rolls the cache back to the longest prefix they
    share with ``conversation`` (a re-tokenised history may split the generated text
    differently) and feeds the rest, so the model sees exactly ``conversation``, as if it
    were prefilled again from scratch. Where a layer cannot roll back that far (a sliding
    window), the cache is reset and the conversation prefilled whole.

    Host-side and stateful by design (it holds the latest cache); every cache operation it
    performs is the pure one.
    """

    def __init__(
        self,
        model: nnx.Module,
        *,
        max_length: int | None = None,
        cache=None,
        tokens: Sequence[int] = (),
        cache_kind: str = "static",
        **cache_kwargs,
    ):
        """A new conversation in a cache of ``max_length`` tokens (``cache_kwargs`` go to
        ``model.init_cache``), or one resumed from a one-row ``cache`` holding ``tokens``
        (e.g. a system prompt loaded with ``jaxkv.persist.load_cache``)."""
        if cache is None:
            cache = model.init_cache(1, max_length, full_attention=cache_kind, **cache_kwargs)
        elif cache.batch_size != 1 or int(cache.lengths[0]) != len(tokens):
            raise ValueError(
                f"a resumed session needs a one-row cache holding exactly `tokens`; got {cache.batch_size} rows "
                f"holding {np.asarray(cache.lengths).tolist()} tokens for {len(tokens)} tokens"
            )
        self.model, self.cache, self.tokens = model, cache, list(tokens)
        self.fed_tokens = 0  # tokens the last turn prefilled (the rest came from the cache)

    def reply(self, conversation: Sequence[int], *, max_new_tokens: int, **generate_kwargs) -> Generation:
        """Generate the answer to ``conversation`` ``[T]`` (token ids); see the class docstring."""
        conversation = list(conversation)
        if not conversation:
            raise ValueError("the conversation is empty: pass its token ids")
        common = next((i for i, (a, b) in enumerate(zip(self.tokens, conversation)) if a != b), None)
        common = min(len(self.tokens), len(conversation)) if common is None else common
        common = min(common, len(conversation) - 1)  # the last token must be fed to get logits
        cache, undo = self.cache, len(self.tokens) - common
        budget = cache.max_rollback
        if budget is None or undo <= budget:
            cache = cache.rollback(undo)
        else:
            cache, common = cache.reset(), 0
        result = generate(self.model, [conversation[common:]], max_new_tokens=max_new_tokens, cache=cache, **generate_kwargs)
        self.cache, self.fed_tokens = result.cache, len(conversation) - common
        self.tokens = conversation + result.row(0)[:-1]
        return result
