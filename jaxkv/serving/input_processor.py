"""Input processing: an ``Engine.add_request`` call checked, argument by argument, and turned
into the request's prompt and ``RequestOptions``. Every refusal is a ``RequestError`` (a
``ValueError``; ``RequestTypeError`` is also a ``TypeError``) whose ``param`` names the
argument, so one bad request never reaches a step, where it would fail the others."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxkv.decoding.sampling import Sampling
from jaxkv.serving.requests import RequestError, RequestOptions, RequestTypeError

MAX_SEED = 2**32 - 1  # a request's seed keys its random stream as a uint32


def _is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _int(name: str, value, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``, or an error naming ``name``."""
    if not _is_int(value):
        raise RequestTypeError(f"add_request: {name} must be an int, got {type(value).__name__}", name)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise RequestError(f"add_request: {name} must be {bound}, got {value}", name)
    return int(value)


def _token_ids(name: str, value, vocab_size: int) -> list[int]:
    """A list (tuple, 1-D array) of ints in ``[0, vocab_size)``."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise RequestTypeError(
            f"add_request: {name} must be a list of token ids (ints), got {type(value).__name__}", name
        )
    if isinstance(value, np.ndarray) and value.ndim != 1:
        raise RequestTypeError(f"add_request: {name} must be one list of token ids, got shape {value.shape}", name)
    ids = list(value)
    wrong = next((t for t in ids if not _is_int(t)), None)
    if wrong is not None:
        raise RequestTypeError(
            f"add_request: {name} must hold ints (token ids), got {type(wrong).__name__} {wrong!r}", name
        )
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise RequestError(f"add_request: {name} token ids must be in [0, {vocab_size})", name)
    return [int(t) for t in ids]


def _stop_strings(value) -> tuple[str, ...]:
    stops = (value,) if isinstance(value, str) else value
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) for s in stops):
        raise RequestTypeError(f"add_request: stop must be a string or a list of strings, got {value!r:.80}", "stop")
    if any(not s for s in stops):
        raise RequestError("add_request: stop strings must not be empty", "stop")
    return tuple(stops)


@dataclasses.dataclass(frozen=True)
class InputProcessor:
    """What a request is checked against: the model's vocabulary and length, the engine's
    logprob limit, the model's end-of-sequence tokens, whether there is a tokenizer (for stop
    strings), and the engine's seed (a request without one draws from ``seed + request id``)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    eos_token_ids: frozenset[int]
    has_tokenizer: bool
    seed: int

    def process(
        self, request_id: int, prompt_ids: Sequence[int], options: RequestOptions
    ) -> tuple[list[int], RequestOptions]:
        """The prompt as a list of ints and the options as the engine keeps them (the model's
        end-of-sequence tokens among ``stop_token_ids`` unless ``ignore_eos``, ``stop`` a tuple,
        ``seed`` drawn from the engine's); raises ``RequestError`` naming the first field at fault."""
        prompt = _token_ids("prompt_ids", prompt_ids, self.vocab_size)
        if not prompt:
            raise RequestError(
                "add_request: prompt_ids is empty; a request needs at least one prompt token", "prompt_ids"
            )
        _check_types(options)
        max_tokens = _int("max_tokens", options.max_tokens, 1)
        _int("n", options.n, 1)
        _int("logprobs", options.logprobs, 0, self.max_logprobs)
        total = len(prompt) + max_tokens
        if total > self.max_model_len:
            raise RequestError(
                f"add_request: prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) is {total}, past "
                f"max_model_len {self.max_model_len}; shorten the prompt or lower max_tokens",
                "max_tokens",
            )
        stops = _stop_strings(options.stop)
        if stops and not self.has_tokenizer:
            raise RequestError("add_request: stop strings need the text: build the Engine with tokenizer=", "stop")
        stop_ids = options.stop_token_ids
        extra = [] if stop_ids is None else _token_ids("stop_token_ids", _listed(stop_ids), self.vocab_size)
        seed = options.seed
        seed = (self.seed + request_id) % (MAX_SEED + 1) if seed is None else _int("seed", seed, 0, MAX_SEED)
        eos = frozenset() if options.ignore_eos else self.eos_token_ids
        return prompt, dataclasses.replace(options, stop_token_ids=frozenset(extra) | eos, stop=stops, seed=seed)


def _listed(ids):
    """A set of token ids as a list (sets are accepted; other iterables are checked as given)."""
    return list(ids) if isinstance(ids, set | frozenset) else ids


def _check_types(options: RequestOptions) -> None:
    """The fields that are checked by type alone: ``sampling``, the two flags and the salt."""
    if not isinstance(options.sampling, Sampling):
        raise RequestTypeError(
            f"add_request: sampling must be a Sampling, got {type(options.sampling).__name__}", "sampling"
        )
    for name in ("ignore_eos", "speculative"):
        if not isinstance(getattr(options, name), bool):
            raise RequestTypeError(
                f"add_request: {name} must be a bool, got {type(getattr(options, name)).__name__}", name
            )
    if options.cache_salt is not None and not isinstance(options.cache_salt, str):
        raise RequestTypeError(
            f"add_request: cache_salt must be a string or None, got {type(options.cache_salt).__name__}", "cache_salt"
        )
