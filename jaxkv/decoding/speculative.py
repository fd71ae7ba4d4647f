"""Speculative decoding in one compiled loop: draft k tokens, verify them in one target
pass of k + 1 tokens, roll the cache back past the ones the target rejects.

Each iteration of one ``lax.while_loop``, for every row of the batch at once:

1. a drafter proposes k tokens ``d_1..d_k`` to follow the row's latest token ``x``;
2. the target runs once on ``[x, d_1, ..., d_k]`` at positions ``L..L+k`` (``L``: tokens
   in its cache), which scores every draft and the token after the last one;
3. the row keeps the longest prefix of drafts the target accepts plus one token of the
   target's own (its correction at the first rejection, or a bonus token after k
   acceptances): m tokens, 1 <= m <= k + 1, for one target pass;
4. the cache forgets the k + 1 - m tokens it stored but the row did not keep
   (``Cache.rollback`` with a per-row count), so each row continues from its own text.

Greedy: a draft is accepted when it equals the target's argmax, so every kept token is
the target's argmax after the same prefix and the output equals
``jaxkv.decoding.generate.generate``'s token for token (up to float rounding between a k+1-token
and a 1-token forward, which never flipped an argmax in the tests).

Sampling (the rule of Leviathan et al. and Chen et al., 2023): with p the target's and q
the drafter's distributions after temperature / top-k / top-p / min-p, draft d is
accepted with probability ``min(1, p(d) / q(d))``; at the first rejection the row's
token is drawn from ``norm(max(0, p - q))``, after k acceptances from p. Every kept token
is then distributed exactly as plain sampling from the target would draw it. A drafter
that proposes deterministically (prompt lookup) has a one-hot q.

Drafters: ``PromptLookup`` (copy what followed the latest earlier occurrence of the
context's last n tokens, computed in-graph), ``DraftModel`` (a smaller model with the
target's vocabulary and its own cache, rolled back with the target's) and
``SelfSpeculation`` (the target's first layers plus its final norm and head; those
layers' K/V equal the target's, so the draft writes straight into the target's cache,
which the verification pass then overwrites).

Cache requirements: the verification writes k + 1 tokens and may undo k, so windowed
(ring) layers need ``rollback_slots >= k`` (``generate_speculative`` builds them so).
Quantized layers with a full-precision residual show a query a key block quantized only
from the token that flushes it on, which one multi-token update cannot show to some
queries and not others: a round verifies no further than ``Cache.exact_chunk_lengths``
(its later drafts count as rejected), so greedy output still equals plain greedy and a
rollback never crosses a flush.
A static cache near its capacity drops the verification's writes past it; those tokens
are never kept, and a row stops with ``Finish.CAPACITY`` exactly where plain decoding
would.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct
from jax.experimental import io_callback

from jaxkv.sizing import bucket
from jaxkv.decoding.generate import (
    Finish,
    Generation,
    Sampling,
    compiled,
    prefill,
    prepare_batch,
    row_finish,
    sample,
    sampling_logits,
)


class Round(NamedTuple):
    """What a drafter sees at the start of one iteration."""

    target: nnx.Module
    cache: Any  # the target's Cache; its ``lengths`` ``[B]`` are L
    draft_params: Any  # the drafter's parameters (loop-invariant), or None
    draft_state: Any  # the drafter's carry (its cache), or None
    history: jax.Array  # [B, S] each row's prompt then generated tokens
    lengths: jax.Array  # [B] tokens of ``history`` in use (L + 1: the latest is not in the cache yet)
    running: jax.Array  # [B] bool
    key: jax.Array
    sampling: Sampling
    num_draft: int
    num_verified: jax.Array  # [B] tokens the verification writes: k + 1, fewer within exact_chunk_lengths


class Proposal(NamedTuple):
    """A drafter's k tokens per row, and its state and the target's cache after drafting."""

    drafts: jax.Array  # [B, k] int32
    logits: jax.Array | None  # [B, k, V] the drafter's logits (None: the drafts are certain)
    draft_state: Any
    cache: Any  # the target's cache (self-speculation writes its first layers)


def latest_tokens(history: jax.Array, lengths: jax.Array) -> jax.Array:
    """``[B]``: each row's last token in ``history`` ``[B, S]``."""
    return jnp.take_along_axis(history, (lengths - 1)[:, None], axis=1)[:, 0]


def lookup_drafts(history, lengths, num_draft: int, max_ngram: int, min_ngram: int) -> jax.Array:
    """Drafts ``[B, k]`` copied from each row's own context (prompt lookup).

    For n from ``max_ngram`` down to ``min_ngram``, find the latest start s < length - n
    where ``history[s:s+n]`` equals the row's last n tokens, and propose the tokens that
    followed it. When the match overlaps the tail (a repeating span of period
    ``p = length - n - s``) the continuation repeats that span instead of reading tokens
    not generated yet. A row with no match proposes its last token k times (cheap to
    verify, and a wrong draft only costs acceptance).
    """
    batch, size = history.shape
    starts = jnp.arange(size, dtype=jnp.int32)[None, :]
    last = latest_tokens(history, lengths)
    drafts = jnp.broadcast_to(last[:, None], (batch, num_draft))
    found = jnp.zeros((batch,), bool)
    for n in range(max_ngram, min_ngram - 1, -1):  # longest n-gram first
        tail = jnp.take_along_axis(history, jnp.maximum(lengths[:, None] - n + jnp.arange(n), 0), axis=1)
        match = starts < (lengths - n)[:, None]
        for i in range(n):
            shifted = jnp.roll(history, -i, axis=1)  # shifted[:, s] = history[:, s + i] for s + i < S
            match &= shifted == tail[:, i : i + 1]
        start = jnp.max(jnp.where(match, starts, -1), axis=1)
        period = jnp.maximum(lengths - n - start, 1)
        index = start[:, None] + n + jnp.arange(num_draft)[None, :] % period[:, None]
        copied = jnp.take_along_axis(history, jnp.clip(index, 0, size - 1), axis=1)
        hit = (start >= 0) & ~found
        drafts = jnp.where(hit[:, None], copied, drafts)
        found |= hit
    return drafts


def draft_tokens(forward, tokens, positions, cache, next_position, rnd: Round, write_until=None):
    """Run a draft model autoregressively: feed ``tokens`` ``[B, T]`` at ``positions``, then
    its own k - 1 samples. Returns the k drafts ``[B, k]``, their logits ``[B, k, V]`` and
    the draft cache (it then holds k - 1 + T more tokens per running row).

    ``forward(tokens, positions, cache) -> (logits [B, T, V], cache)``; ``next_position``
    ``[B]`` is the position of the first sampled draft. With ``write_until`` ``[B]``, a
    sample at or past it is fed as padding (not stored); such drafts go unverified.
    """
    keys = jax.random.split(rnd.key, rnd.num_draft)
    logits, cache = forward(tokens, positions, cache)
    first_logits = logits[:, -1]
    first = sample(first_logits, keys[0], rnd.sampling)

    def step(carry, step_key):
        token, position, cache = carry
        stored = rnd.running if write_until is None else rnd.running & (position < write_until)
        logits, cache = forward(token[:, None], jnp.where(stored, position, -1)[:, None], cache)
        new = sample(logits[:, -1], step_key, rnd.sampling)
        return (new, position + 1, cache), (new, logits[:, -1])

    (_, _, cache), (rest, rest_logits) = jax.lax.scan(step, (first, next_position, cache), keys[1:])
    drafts = jnp.concatenate([first[:, None], rest.T], axis=1)
    logits = jnp.concatenate([first_logits[:, None], jnp.swapaxes(rest_logits, 0, 1)], axis=1)
    return drafts, logits, cache


class Drafter(abc.ABC):
    """What the decode loop asks of a drafter; this base is a drafter without state.

    ``propose`` runs inside the compiled loop; ``commit`` tells it how many of the round's
    tokens each row kept (``kept`` ``[B]``, 0 for stopped rows). A drafter is static
    under ``jit`` (hashable); its weights, if any, are ``params()``, an ordinary input.
    """

    def check(self, target) -> None:
        """Raise if this drafter cannot serve ``target``."""

    def params(self):
        return None

    def start(self, prompt_tokens, prompt_lengths, cache_settings: dict, reserve: int):
        """The drafter's carry after the prompts ``[B, W]`` and the seconds spent compiling."""
        return None, 0.0

    @abc.abstractmethod
    def propose(self, rnd: Round) -> Proposal:
        """Drafts ``[B, k]`` for the running rows (what stopped rows get does not matter)."""

    def commit(self, draft_state, proposal: Proposal, kept, running):
        return draft_state


@dataclasses.dataclass(frozen=True)
class PromptLookup(Drafter):
    """Draft by copying from the context (prompt and generated text): n-gram lookup.

    Free: no model runs to draft. Pays off when the output repeats its input (editing,
    summarising, code), where whole spans are accepted at once.
    """

    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"PromptLookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(self, rnd: Round) -> Proposal:
        drafts = lookup_drafts(rnd.history, rnd.lengths, rnd.num_draft, self.max_ngram, self.min_ngram)
        return Proposal(drafts, None, rnd.draft_state, rnd.cache)


@dataclasses.dataclass(frozen=True)
class SelfSpeculation(Drafter):
    """Draft with the target's first ``exit_layer`` layers plus its final norm and head.

    The target must accept ``num_layers=`` (``jaxkv.models.llama.Llama`` and ``jaxkv.models.gemma3.Gemma3`` do). Those layers'
    K/V are exactly the target's, so the draft writes them into the target's cache;
    the verification pass rewrites the same positions, and the rollback undoes both.
    Drafts past what the round verifies are not stored, so the draft never writes a
    position the verification does not rewrite.
    """

    exit_layer: int

    def check(self, target) -> None:
        if "num_layers" not in inspect.signature(type(target).__call__).parameters:
            raise TypeError(
                f"SelfSpeculation needs a target called with num_layers= (early exit); {type(target).__name__} is not. "
                "Use PromptLookup or DraftModel instead"
            )
        layers = target.config.num_hidden_layers
        if not 1 <= self.exit_layer < layers:
            raise ValueError(
                f"SelfSpeculation: exit_layer must be in [1, {layers}) for this target, got {self.exit_layer}"
            )

    def propose(self, rnd: Round) -> Proposal:
        def forward(tokens, positions, cache):
            return rnd.target(tokens, positions, cache, num_layers=self.exit_layer)

        lengths = rnd.cache.lengths
        positions = jnp.where(rnd.running, lengths, -1)[:, None]
        last = latest_tokens(rnd.history, rnd.lengths)
        drafts, logits, cache = draft_tokens(
            forward, last[:, None], positions, rnd.cache, lengths + 1, rnd, write_until=lengths + rnd.num_verified
        )
        return Proposal(drafts, logits, rnd.draft_state, cache)


class DraftState(struct.PyTreeNode):
    """A draft model's carry: its cache and, per row, a kept draft it has not stored yet.

    The draft feeds ``x, d_1..d_{k-1}``; when all k drafts are kept, ``d_k`` is in the
    target's text but not in the draft cache, so it is fed first next round (``pending``,
    -1 when there is none): one 2-token step instead of an extra draft step.
    """

    cache: Any
    pending: jax.Array  # [B] int32


class DraftModel(Drafter):
    """A separate (smaller) draft model with the target's vocabulary and its own cache.

    Built from an ``nnx.Module`` called like the target; equal (and hashed, for the
    compiled-code cache) by its graph definition, so its weights are ordinary inputs.
    """

    def __init__(self, model: nnx.Module):
        self.model = model
        self.graphdef, self.state = nnx.split(model)

    def __hash__(self):
        return hash(self.graphdef)

    def __eq__(self, other):
        return isinstance(other, DraftModel) and self.graphdef == other.graphdef

    def check(self, target) -> None:
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"DraftModel: the draft's vocabulary ({self.model.config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}); a draft model must share the target's tokenizer"
            )

    def params(self):
        return self.state

    def start(self, prompt_tokens, prompt_lengths, cache_settings: dict, reserve: int):
        """Prefill the draft model's own cache (built like the target's) with the prompts."""
        cache = self.model.init_cache(len(prompt_lengths), **cache_settings).reserve(reserve)
        fill, seconds = compiled(
            prefill, {"sampling": Sampling()}, self.graphdef, self.state, cache, prompt_tokens, prompt_lengths,
            jax.random.key(0),
        )  # fmt: skip
        _, cache = fill(self.state, cache, prompt_tokens, prompt_lengths, jax.random.key(0))
        return DraftState(cache, jnp.full((len(prompt_lengths),), -1, jnp.int32)), seconds

    def propose(self, rnd: Round) -> Proposal:
        model = nnx.merge(self.graphdef, rnd.draft_params)
        state: DraftState = rnd.draft_state
        lengths = rnd.cache.lengths  # the draft cache holds the same tokens, less a pending one
        pending = state.pending
        tokens = jnp.stack([jnp.maximum(pending, 0), latest_tokens(rnd.history, rnd.lengths)], axis=1)
        positions = jnp.stack([jnp.where(pending >= 0, lengths - 1, -1), lengths], axis=1)
        positions = jnp.where(rnd.running[:, None], positions, -1)
        drafts, logits, cache = draft_tokens(model, tokens, positions, state.cache, lengths + 1, rnd)
        return Proposal(drafts, logits, state.replace(cache=cache), rnd.cache)

    def commit(self, draft_state: DraftState, proposal: Proposal, kept, running):
        """The draft cache holds ``L + k`` tokens; the row kept ``L + kept``."""
        k = proposal.drafts.shape[1]
        all_kept = running & (kept == k + 1)
        cache = draft_state.cache.rollback(jnp.where(running, jnp.maximum(k - kept, 0), 0))
        pending = jnp.where(all_kept, proposal.drafts[:, -1], jnp.where(running, -1, draft_state.pending))
        return DraftState(cache, pending)


def verify(target_logits, drafts, draft_logits, key, sampling: Sampling, num_checked=None) -> tuple[jax.Array, jax.Array]:
    """Which drafts the target accepts, and the row's tokens for this round.

    ``target_logits`` ``[B, k+1, V]`` (position j scores the token after ``x, d_1..d_j``),
    ``drafts`` ``[B, k]``, ``draft_logits`` ``[B, k, V]`` or None (one-hot q). With
    ``num_checked`` ``[B]``, only a row's first ``num_checked`` drafts were verified: the
    rest count as never proposed. Returns ``num_accepted`` ``[B]`` (n) and ``tokens``
    ``[B, k+1]``: ``tokens[:, :n]`` are the accepted drafts and ``tokens[:, n]`` the
    target's own next token (later entries are unspecified).
    """
    batch, width, vocab = target_logits.shape
    k = width - 1
    checked = jnp.arange(k)[None, :] < (k if num_checked is None else num_checked[:, None])
    if sampling.temperature == 0:
        best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
        agree = (drafts == best[:, :-1]) & checked
        num_accepted = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
        return num_accepted, best  # where accepted, the draft is the argmax

    def probs(logits):
        flat = sampling_logits(logits.reshape(-1, vocab), sampling)
        return jax.nn.softmax(flat, axis=-1).reshape(logits.shape)

    p = probs(target_logits)
    q = jax.nn.one_hot(drafts, vocab, dtype=p.dtype) if draft_logits is None else probs(draft_logits)
    p_draft = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=2)[..., 0]
    q_draft = jnp.take_along_axis(q, drafts[..., None], axis=2)[..., 0]
    accept_key, residual_key = jax.random.split(key)
    # Accept with probability min(1, p/q): u < p/q, written without dividing by q.
    accepted = (jax.random.uniform(accept_key, (batch, k)) * q_draft < p_draft) & checked
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)
    rows = jnp.arange(batch)
    p_next = p[rows, num_accepted]
    # q = 0 after the last checked draft: the row's token then comes from p, as after k acceptances.
    q_next = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, num_accepted]
    if num_checked is not None:
        q_next = jnp.where((num_accepted < num_checked)[:, None], q_next, 0.0)
    residual = jnp.maximum(p_next - q_next, 0.0)
    # p == q makes a rejection impossible, but rounding could still empty the residual.
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_next)
    own = jax.random.categorical(residual_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    tokens = jnp.concatenate([drafts, drafts[:, :1]], axis=1).at[rows, num_accepted].set(own)
    return num_accepted, tokens


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "drafter", "sampling", "max_new_tokens", "num_draft", "stream"),
    donate_argnames=("cache", "draft_state", "history"),
)
def speculative_decode(
    graphdef, state, cache, draft_params, draft_state, history, lengths, key, stop_tokens,
    *, drafter, sampling, max_new_tokens, num_draft, stream=None,
):  # fmt: skip
    """Decode speculatively until every row has stopped.

    ``history`` ``[B, S]``: each row's prompt and first generated token, ``lengths``
    ``[B]`` how many (the first generated token is not in ``cache`` yet). Returns the
    history, the per-row generated counts, finish reasons, target passes and accepted
    drafts, and the caches. ``stream``, if given, receives each round's tokens ``[B, k+1]``
    (-1 past what a row kept) through ``io_callback``.
    """
    target = nnx.merge(graphdef, state)
    batch, size = history.shape
    capacity = cache.max_length
    rows = jnp.arange(batch)[:, None]
    offsets = jnp.arange(num_draft + 1, dtype=jnp.int32)[None, :]

    def emit(tokens):
        if stream is not None:
            io_callback(stream, None, tokens, ordered=True)

    first = latest_tokens(history, lengths)
    emit(jnp.concatenate([first[:, None], jnp.full((batch, num_draft), -1, jnp.int32)], axis=1))
    count = jnp.ones((batch,), jnp.int32)
    reason = row_finish(first, count, cache.lengths, stop_tokens, max_new_tokens, capacity)
    zeros = jnp.zeros((batch,), jnp.int32)

    def cond(carry):
        return jnp.any(carry["reason"] == Finish.RUNNING)

    def body(carry):
        running = carry["reason"] == Finish.RUNNING
        key, draft_key, verify_key = jax.random.split(carry["key"], 3)
        start = carry["cache"].lengths
        exact = carry["cache"].exact_chunk_lengths()
        num_verified = jnp.full((batch,), num_draft + 1) if exact is None else jnp.minimum(exact, num_draft + 1)
        rnd = Round(
            target, carry["cache"], draft_params, carry["draft_state"], carry["history"], carry["lengths"],
            running, draft_key, sampling, num_draft, num_verified,
        )  # fmt: skip
        proposal = drafter.propose(rnd)
        tokens = jnp.concatenate([latest_tokens(carry["history"], carry["lengths"])[:, None], proposal.drafts], axis=1)
        written = running[:, None] & (offsets < num_verified[:, None])
        positions = jnp.where(written, start[:, None] + offsets, -1)
        logits, cache = target(tokens, positions, proposal.cache)
        num_accepted, new = verify(logits, proposal.drafts, proposal.logits, verify_key, sampling, num_verified - 1)

        # Keep the accepted drafts and the target's token, cut at a stop token, at
        # max_new_tokens and at the capacity (a query past it missed its own key).
        kept = jnp.minimum(num_accepted + 1, max_new_tokens - carry["count"])
        if capacity is not None:
            kept = jnp.minimum(kept, capacity - start)
        is_stop = jnp.isin(new, stop_tokens) & (offsets < kept[:, None])
        kept = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, kept)
        kept = jnp.where(running, kept, 0)
        new = jnp.where(offsets < kept[:, None], new, -1)
        emit(new)

        slots = jnp.where(offsets < kept[:, None], carry["lengths"][:, None] + offsets, size)
        history = carry["history"].at[rows, slots].set(new, mode="drop")
        cache = cache.rollback(jnp.where(running, num_verified - kept, 0))
        count = carry["count"] + kept
        latest = jnp.take_along_axis(new, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
        finished = row_finish(latest, count, cache.lengths, stop_tokens, max_new_tokens, capacity)
        return {
            "cache": cache,
            "draft_state": drafter.commit(proposal.draft_state, proposal, kept, running),
            "history": history,
            "lengths": carry["lengths"] + kept,
            "count": count,
            "reason": jnp.where(running, finished, carry["reason"]),
            "key": key,
            "target_steps": carry["target_steps"] + running,
            "accepted": carry["accepted"] + jnp.where(running, num_accepted, 0),
        }

    carry = {
        "cache": cache, "draft_state": draft_state, "history": history, "lengths": lengths, "count": count,
        "reason": reason, "key": key, "target_steps": zeros, "accepted": zeros,
    }  # fmt: skip
    return jax.lax.while_loop(cond, body, carry)


@dataclasses.dataclass(kw_only=True)
class SpeculativeGeneration(Generation):
    """A ``Generation`` plus per-row target passes and accepted drafts."""

    target_steps: np.ndarray  # [B] verification passes (the first token comes from the prefill)
    accepted: np.ndarray  # [B] drafts the target accepted
    num_draft_tokens: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts, all rows."""
        return float(self.accepted.sum() / max(1, self.target_steps.sum() * self.num_draft_tokens))

    @property
    def tokens_per_step(self) -> float:
        """Tokens generated per target pass after the prefill, all rows."""
        return float((self.num_generated - 1).sum() / max(1, self.target_steps.sum()))


def generate_speculative(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    drafter: Drafter,
    num_draft_tokens: int = 4,
    max_new_tokens: int,
    stop_tokens: Sequence[int] = (),
    sampling: Sampling = Sampling(),
    seed: int = 0,
    cache_kind: str = "static",
    max_length: int | None = None,
    stream: Callable[[np.ndarray], None] | None = None,
    **cache_kwargs,
) -> SpeculativeGeneration:
    """``jaxkv.decoding.generate.generate`` with speculative decoding (see the module docstring).

    Same prompts, padding, cache building and finish reasons; greedy output is the same.
    ``num_draft_tokens`` (k) drafts per round; windowed cache layers get
    ``rollback_slots >= k``. ``stream(tokens [B, k+1])`` receives each round's tokens.
    """
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
    drafter.check(model)
    cache_kwargs["rollback_slots"] = max(cache_kwargs.get("rollback_slots", 0), num_draft_tokens)
    tokens, prompt_lengths, cache = prepare_batch(
        model, prompts, max_new_tokens=max_new_tokens, cache_kind=cache_kind, max_length=max_length, **cache_kwargs
    )
    if cache.max_rollback is not None and cache.max_rollback < num_draft_tokens:
        raise ValueError(
            f"this cache can undo {cache.max_rollback} tokens but a round may reject all {num_draft_tokens} drafts; "
            f"lower num_draft_tokens or use layers that can roll back further"
        )
    # A verification writes up to k + 1 tokens past the kept ones.
    reserve = tokens.shape[1] + max_new_tokens + num_draft_tokens + 1
    cache = cache.reserve(reserve)
    draft_length = max_length or bucket(reserve)
    cache_settings = dict(max_length=draft_length, full_attention=cache_kind, **cache_kwargs)
    graphdef, state = nnx.split(model)
    key_prefill, key_decode = jax.random.split(jax.random.key(seed))
    stop = jnp.asarray(list(stop_tokens) or [-2], jnp.int32)

    prefill_c, compile_seconds = compiled(
        prefill, {"sampling": sampling}, graphdef, state, cache, tokens, prompt_lengths, key_prefill
    )
    start = time.perf_counter()
    first, cache = prefill_c(state, cache, tokens, prompt_lengths, key_prefill)
    draft_state, draft_compile = drafter.start(tokens, prompt_lengths, cache_settings, reserve)
    jax.block_until_ready((first, draft_state))
    prefill_seconds = time.perf_counter() - start - draft_compile

    history = np.zeros((len(prompts), tokens.shape[1] + max_new_tokens), np.int32)
    history[:, : tokens.shape[1]] = tokens
    history[np.arange(len(prompts)), prompt_lengths] = np.asarray(first)
    args = (state, cache, drafter.params(), draft_state, history, prompt_lengths + 1, key_decode, stop)
    static = {
        "sampling": sampling, "drafter": drafter, "max_new_tokens": max_new_tokens, "num_draft": num_draft_tokens,
        "stream": stream,
    }  # fmt: skip
    decode_c, decode_compile = compiled(speculative_decode, static, graphdef, *args)
    start = time.perf_counter()
    out = decode_c(*args)
    history = np.asarray(out["history"])
    decode_seconds = time.perf_counter() - start

    counts = np.asarray(out["count"])
    generated = np.full((len(prompts), max_new_tokens), -1, np.int32)
    for row, (begin, n) in enumerate(zip(prompt_lengths, counts)):
        generated[row, :n] = history[row, begin : begin + n]
    return SpeculativeGeneration(
        generated, counts, [Finish(int(r)) for r in np.asarray(out["reason"])], prefill_seconds, decode_seconds,
        compile_seconds + draft_compile + decode_compile, out["cache"].nbytes, out["cache"],
        target_steps=np.asarray(out["target_steps"]), accepted=np.asarray(out["accepted"]),
        num_draft_tokens=num_draft_tokens,
    )  # fmt: skip
