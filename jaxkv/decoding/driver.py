"""The one driver every decoding strategy runs on (``drive``).

A run, whatever the strategy (``generate``, ``beam_search``, ``generate_speculative``;
``prefill_prefix`` stops after step 3):

1. ``Request.create`` reads the keywords all entry points share; ``prepare_batch`` checks
   the model contract (``jaxkv.decoding.model``), right-pads the prompts to a power-of-two
   bucket (padding positions are -1: neither stored nor attended) and builds the cache, or
   continues the caller's, refusing a prompt that cannot fit before anything compiles;
2. an encoder-decoder model encodes its ``encoder_inputs`` into the cache (``encode``);
3. ``prefill`` feeds the prompts and returns each row's next-token logits ``[B, V]``. The
   cache is donated unless it is the caller's: ``prefill_shared`` leaves a shared prefix
   valid for further requests. The strategy prepares its own state alongside
   (``Strategy.start``: a draft model's cache);
4. the strategy's compiled loop runs from those logits until every row has finished, the
   cache in its carry;
5. the strategy builds its result from the loop's final carry.

Every compiled step is compiled once per shape family (``compiled``: a bounded LRU of
executables; prompt widths are bucketed) and timed apart from its compilation (``Timings``).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from jaxkv.decoding.model import DecoderModel, EncoderDecoderModel, check_model
from jaxkv.decoding.sampling import GREEDY, Sampling
from jaxkv.sharding import to_host
from jaxkv.sizing import bucket

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


@dataclasses.dataclass
class Timings:
    """Seconds a run spent: encoding and prefilling, its loop, and compiling either."""

    prefill_seconds: float = 0.0
    loop_seconds: float = 0.0
    compile_seconds: float = 0.0

    def prefill(self, fn, static: dict, graphdef, *args):
        """``fn(graphdef, *args)`` compiled and run to completion, timed as prefill."""
        out, seconds = self._run(fn, static, graphdef, *args)
        self.prefill_seconds += seconds
        return out

    def loop(self, fn, static: dict, graphdef, *args):
        """``fn(graphdef, *args)`` compiled and run to completion, timed as the loop."""
        out, seconds = self._run(fn, static, graphdef, *args)
        self.loop_seconds += seconds
        return out

    def _run(self, fn, static: dict, graphdef, *args) -> tuple[Any, float]:
        executable, compile_seconds = compiled(fn, static, graphdef, *args)
        self.compile_seconds += compile_seconds
        start = time.perf_counter()
        out = jax.block_until_ready(executable(*args))  # graphdef is static: compiled in, not passed
        return out, time.perf_counter() - start


def emit(stream: Callable[[np.ndarray], None] | None, tokens: jax.Array) -> None:
    """Hand ``tokens`` to ``stream`` on the host, in step order (inside a compiled loop)."""
    if stream is not None:
        io_callback(stream, None, tokens, ordered=True)


def full_attention_keyword(full_attention: str | None, cache_kind: str | None, *, stacklevel: int) -> str:
    """The storage of full-attention layers (default ``"static"``), from ``full_attention=``
    or its deprecated alias ``cache_kind=`` (warned at the caller ``stacklevel`` frames up)."""
    if cache_kind is None:
        return full_attention or "static"
    if full_attention is not None:
        raise ValueError("cache_kind= is the deprecated name of full_attention=: pass only full_attention=")
    warnings.warn(
        "cache_kind= is deprecated and will be removed: pass full_attention= (the same values)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return cache_kind


@dataclasses.dataclass(frozen=True)
class CacheSource:
    """Where a run's cache comes from: the caller's ``given`` cache, continued (a prefilled
    prefix, a previous chat turn, a loaded file; never donated, so it can seed many runs),
    or a fresh ``model.init_cache`` with ``full_attention``, ``max_length`` and ``settings``
    (the model's further cache keywords: ``rollback_slots``, ``quantization``, ``dtype``, ...)."""

    given: Any = None
    full_attention: str = "static"
    max_length: int | None = None
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def fresh(self, model: DecoderModel, batch_size: int, max_length: int | None = None, **more) -> Any:
        """An empty cache of ``batch_size`` rows holding ``max_length`` tokens (default: this
        source's); ``more``: further ``init_cache`` keywords of this run."""
        max_length = self.max_length if max_length is None else max_length
        return model.init_cache(batch_size, max_length, full_attention=self.full_attention, **self.settings, **more)

    def with_settings(self, **settings) -> CacheSource:
        return dataclasses.replace(self, settings={**self.settings, **settings})


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """What a run is asked, whatever its strategy; ``create`` reads the entry points' keywords."""

    max_new_tokens: int
    stop_tokens: tuple[int, ...] = ()  # sorted, distinct
    sampling: Sampling = GREEDY
    seed: int = 0
    stream: Callable[[np.ndarray], None] | None = None
    encoder_inputs: Sequence[Sequence[int]] | None = None
    cache_source: CacheSource = CacheSource()

    @classmethod
    def create(
        cls,
        *,
        max_new_tokens: int,
        stop_tokens: Sequence[int] = (),
        sampling: Sampling = GREEDY,
        seed: int = 0,
        stream: Callable[[np.ndarray], None] | None = None,
        encoder_inputs: Sequence[Sequence[int]] | None = None,
        cache=None,
        full_attention: str | None = None,
        max_length: int | None = None,
        cache_kind: str | None = None,
        **cache_settings,
    ) -> Request:
        """The keywords of ``generate``, ``beam_search``, ``generate_speculative`` and ``prefill_prefix``:

        ``max_new_tokens``: most tokens generated per row; ``stop_tokens``: a row stops
        after generating one; ``sampling`` and ``seed``: how tokens are drawn (greedy by
        default); ``stream(tokens)``: called on the host with each step's new tokens;
        ``encoder_inputs``: one token sequence per prompt, for an encoder-decoder model (the
        prompts are then the decoder's, e.g. its start token); ``cache``: continue from it;
        else a fresh cache of ``max_length`` tokens (default: the prompt bucket plus
        ``max_new_tokens``, rounded up to a bucket), ``full_attention`` ``"static"`` or
        ``"dynamic"`` storage, and ``cache_settings`` for ``model.init_cache``
        (``rollback_slots``, ``quantization``, ``dtype``, ...). ``cache_kind``: the
        deprecated name of ``full_attention``.
        """
        storage = full_attention_keyword(full_attention, cache_kind, stacklevel=4)
        return cls(
            max_new_tokens=max_new_tokens,
            stop_tokens=tuple(sorted(set(stop_tokens))),
            sampling=sampling,
            seed=seed,
            stream=stream,
            encoder_inputs=encoder_inputs,
            cache_source=CacheSource(cache, storage, max_length, cache_settings),
        )

    @property
    def stop_array(self) -> jax.Array:
        """``[N]`` int32 stop tokens; -2 (never generated) stands in for none."""
        return jnp.asarray(self.stop_tokens or (-2,), jnp.int32)

    @property
    def key(self) -> jax.Array:
        return jax.random.key(self.seed)


@dataclasses.dataclass(frozen=True)
class Batch:
    """Prompts ready to prefill: ``tokens`` ``[B, W]`` right-padded, ``prompt_lengths`` ``[B]``,
    the ``cache`` they continue, whether it is the caller's (``shared``: never donated), and
    an encoder-decoder model's padded ``encoder`` inputs (tokens, positions ``[B, S]``)."""

    tokens: np.ndarray
    prompt_lengths: np.ndarray
    cache: Any
    shared: bool
    encoder: tuple[np.ndarray, np.ndarray] | None


def prepare_batch(
    model: DecoderModel, prompts: Sequence[Sequence[int]], request: Request, extra_slots: int = 0
) -> Batch:
    """Right-padded prompts and the cache to feed them into (see the module docstring).

    ``W`` is the longest prompt rounded up to a power-of-two bucket, so new prompt lengths
    reuse compiled code. A given cache of one row is repeated to every prompt. Growing
    layers reserve room for the prompts, ``max_new_tokens`` and ``extra_slots`` (tokens a
    strategy writes past those it keeps).
    """
    check_model(model, DecoderModel)
    if request.max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {request.max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    prompt_lengths = np.array([len(p) for p in prompts], np.int32)
    width = bucket(int(prompt_lengths.max()))
    encoder = encoder_batch(model, request, len(prompts))
    cache, capacity, cached = starting_cache(model, request, len(prompts), width, encoder)
    cache = cache.reserve(width + request.max_new_tokens + extra_slots)  # grows dynamic layers only
    check_fits(model, int((cached + prompt_lengths).max()), capacity)
    if capacity is not None:  # padding must fit the buffer too (a small cache continued)
        width = min(width, capacity)
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return Batch(tokens, prompt_lengths, cache, request.cache_source.given is not None, encoder)


def starting_cache(model, request: Request, num_rows: int, width: int, encoder) -> tuple[Any, int | None, np.ndarray]:
    """The cache the prompts continue, the tokens it may hold (None: unbounded) and the
    tokens each row ``[B]`` holds already."""
    source = request.cache_source
    if source.given is None:
        max_length = source.max_length or bucket(width + request.max_new_tokens)
        more = {} if encoder is None else {"encoder_length": encoder[0].shape[1]}
        return source.fresh(model, num_rows, max_length, **more), max_length, np.zeros(num_rows, np.int32)
    if source.max_length is not None or source.settings:
        raise ValueError("pass either a cache to continue or settings to build one (max_length, ...), not both")
    cache = source.given
    if cache.batch_size == 1 < num_rows:
        cache = cache.repeat(num_rows)
    if cache.batch_size != num_rows:
        raise ValueError(
            f"the cache has {cache.batch_size} rows for {num_rows} prompts; pass one row or one per prompt"
        )
    return cache, cache.max_length, to_host(cache.lengths)


def check_fits(model: DecoderModel, needed: int, capacity: int | None) -> None:
    """Refuse a sequence of ``needed`` tokens (cached + prompt) the cache or the model cannot hold."""
    limit = model.config.max_position_embeddings
    if (capacity is not None and needed >= capacity) or needed >= limit:
        raise ValueError(
            f"a sequence of {needed} tokens (cached + prompt) cannot fit: the cache holds {capacity} tokens and "
            f"the model {limit} positions; shorten the prompt or raise max_length"
        )


def encoder_batch(model, request: Request, num_prompts: int) -> tuple[np.ndarray, np.ndarray] | None:
    """An encoder-decoder model's padded ``encoder_inputs`` (see ``pad_encoder_inputs``);
    None for a decoder-only run or a given cache, which holds its encoder input already."""
    given = request.cache_source.given is not None
    if request.encoder_inputs is None:
        if not given and isinstance(model, EncoderDecoderModel):
            raise ValueError(f"{type(model).__name__} is an encoder-decoder model: pass encoder_inputs, one per prompt")
        return None
    check_model(model, EncoderDecoderModel, "pass encoder_inputs only to an encoder-decoder model")
    encoder = pad_encoder_inputs(model, request.encoder_inputs, num_prompts)
    if given:
        raise ValueError("encoder_inputs need a fresh cache; a given cache already holds its encoder input")
    return encoder


def pad_encoder_inputs(model: EncoderDecoderModel, encoder_inputs: Sequence[Sequence[int]], num_prompts: int):
    """Encoder inputs right-padded to a power-of-two bucket: tokens and positions ``[B, S]``
    (-1 for padding), so new input lengths reuse the compiled encode and decode."""
    if len(encoder_inputs) != num_prompts or any(len(x) == 0 for x in encoder_inputs):
        raise ValueError(
            f"pass one non-empty encoder input per prompt: {len(encoder_inputs)} for {num_prompts} prompts"
        )
    lengths = np.array([len(x) for x in encoder_inputs])
    limit = model.config.max_position_embeddings
    if lengths.max() > limit:
        raise ValueError(
            f"an encoder input of {lengths.max()} tokens exceeds the model's {limit} positions; shorten it"
        )
    width = bucket(int(lengths.max()))
    tokens, positions = np.zeros((len(lengths), width), np.int32), np.full((len(lengths), width), -1, np.int32)
    for row, inputs in enumerate(encoder_inputs):
        tokens[row, : len(inputs)], positions[row, : len(inputs)] = inputs, np.arange(len(inputs))
    return tokens, positions


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def encode(graphdef, state, cache, tokens, positions):
    """Encoder-decoder models: run the encoder on right-padded inputs ``[B, S]`` (positions
    -1 for padding) and store the cross-attention K/V it gives in the cache, once, before
    the decoder prefill."""
    return nnx.merge(graphdef, state).encode(tokens, positions, cache)


def _prefill(graphdef, state, cache, tokens, prompt_lengths):
    """Feed right-padded prompts ``[B, T]`` after what each row's cache already holds.

    Returns the logits ``[B, V]`` at each row's last prompt token and the updated cache.
    """
    positions = cache.next_positions(tokens.shape[1], num_new=prompt_lengths)
    logits, cache = nnx.merge(graphdef, state)(tokens, positions, cache, logits_index=prompt_lengths - 1)
    return logits[:, 0], cache


prefill = jax.jit(_prefill, static_argnames=("graphdef",), donate_argnames=("cache",))
# The same step on a caller's cache (a shared prefix): not donated, so the caller's cache
# stays valid for further continuations; XLA copies the buffer once instead.
prefill_shared = jax.jit(_prefill, static_argnames=("graphdef",))


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A batch after its prefill: the split model, the prompts (``tokens`` ``[B, W]``,
    ``prompt_lengths`` ``[B]``), each row's next-token ``logits`` ``[B, V]``, the cache
    holding the prompts, and the run's ``timings`` so far."""

    graphdef: Any
    state: Any
    tokens: np.ndarray
    prompt_lengths: np.ndarray
    logits: jax.Array
    cache: Any
    timings: Timings


def prefill_batch(model: DecoderModel, batch: Batch) -> Prefilled:
    """Encode (encoder-decoder models) and prefill ``batch``; its cache is donated unless shared."""
    graphdef, state = nnx.split(model)
    timings, cache = Timings(), batch.cache
    if batch.encoder is not None:
        cache = timings.prefill(encode, {}, graphdef, state, cache, *batch.encoder)
    fill = prefill_shared if batch.shared else prefill
    logits, cache = timings.prefill(fill, {}, graphdef, state, cache, batch.tokens, batch.prompt_lengths)
    return Prefilled(graphdef, state, batch.tokens, batch.prompt_lengths, logits, cache, timings)


class Loop(NamedTuple):
    """A strategy's compiled loop: the jitted function, its static keywords and its
    arguments after ``graphdef``."""

    fn: Callable
    static: dict
    args: tuple


class Strategy(abc.ABC):
    """A decoding strategy's part of a run (see the module docstring); ``drive`` does the rest."""

    request: Request

    @property
    def extra_slots(self) -> int:
        """Tokens the loop writes past those it keeps, reserved in growing layers."""
        return 0

    def check(self, batch: Batch) -> None:
        """Refuse a batch this strategy cannot decode, before anything compiles."""

    def start(self, run: Prefilled) -> Any:
        """The strategy's own state, prepared after the prefill and timed with it."""
        return None

    @abc.abstractmethod
    def loop(self, run: Prefilled, started: Any) -> Loop:
        """The loop from the prefilled batch (and what ``start`` returned) to the end."""

    @abc.abstractmethod
    def result(self, carry: Any, run: Prefilled) -> Any:
        """The strategy's result from the loop's final carry (``run.timings`` complete)."""


def drive(model: DecoderModel, prompts: Sequence[Sequence[int]], strategy: Strategy) -> Any:
    """Decode ``prompts`` (token ids, one row each) with ``strategy``: prepare, encode and
    prefill, start the strategy, run its loop, build its result."""
    batch = prepare_batch(model, prompts, strategy.request, strategy.extra_slots)
    strategy.check(batch)
    run = prefill_batch(model, batch)
    started = strategy.start(run)
    fn, static, args = strategy.loop(run, started)
    carry = run.timings.loop(fn, static, run.graphdef, *args)
    return strategy.result(carry, run)
