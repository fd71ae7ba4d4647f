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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.decoding.driver import Batch, CacheSource, Loop, Prefilled, Request, Strategy, drive, emit, prefill
from jaxkv.decoding.generate import Finish, Generation, Limits
from jaxkv.decoding.model import DecoderModel, EarlyExitModel, EncoderDecoderModel, check_model
from jaxkv.decoding.sampling import Sampling, sample, sampling_logits
from jaxkv.protocol import pytree_class
from jaxkv.sharding import to_host
from jaxkv.sizing import bucket


class Round(NamedTuple):
    """What a drafter sees at the start of one iteration."""

    target: nnx.Module
    cache: Any  # the target's Cache; its ``lengths`` ``[B]`` are L
    draft_params: Any  # the drafter's parameters (loop-invariant), or None
    draft_state: Any  # the drafter's carry (its cache), or None
    history: jax.Array  # [B, S] each row's prompt then generated tokens
    history_lengths: jax.Array  # [B] tokens of ``history`` in use (L + 1: the latest is not in the cache yet)
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


def latest_tokens(history: jax.Array, history_lengths: jax.Array) -> jax.Array:
    """``[B]``: each row's last token in ``history`` ``[B, S]`` (``history_lengths`` ``[B]`` in use)."""
    return jnp.take_along_axis(history, (history_lengths - 1)[:, None], axis=1)[:, 0]


def lookup_drafts(history, history_lengths, num_draft: int, max_ngram: int, min_ngram: int) -> jax.Array:
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
    last = latest_tokens(history, history_lengths)
    drafts = jnp.broadcast_to(last[:, None], (batch, num_draft))
    found = jnp.zeros((batch,), bool)
    for n in range(max_ngram, min_ngram - 1, -1):  # longest n-gram first
        tail = jnp.take_along_axis(history, jnp.maximum(history_lengths[:, None] - n + jnp.arange(n), 0), axis=1)
        match = starts < (history_lengths - n)[:, None]
        for i in range(n):
            shifted = jnp.roll(history, -i, axis=1)  # shifted[:, s] = history[:, s + i] for s + i < S
            match &= shifted == tail[:, i : i + 1]
        start = jnp.max(jnp.where(match, starts, -1), axis=1)
        period = jnp.maximum(history_lengths - n - start, 1)
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

    def check(self, target: DecoderModel) -> None:
        """Raise if this drafter cannot serve ``target``."""

    def params(self):
        return None

    def start(self, run: Prefilled, cache_source: CacheSource, reserve: int):
        """The drafter's carry after the prompts ``run.tokens`` ``[B, W]``; a cache of its own
        comes from ``cache_source`` with room for ``reserve`` tokens per row (None: no carry)."""

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
        drafts = lookup_drafts(rnd.history, rnd.history_lengths, rnd.num_draft, self.max_ngram, self.min_ngram)
        return Proposal(drafts, None, rnd.draft_state, rnd.cache)


@dataclasses.dataclass(frozen=True)
class SelfSpeculation(Drafter):
    """Draft with the target's first ``exit_layer`` layers plus its final norm and head.

    The target must be an ``EarlyExitModel`` (``jaxkv.models.llama.Llama`` and
    ``jaxkv.models.gemma3.Gemma3`` are). Those layers' K/V are exactly the target's, so
    the draft writes them into the target's cache; the verification pass rewrites the
    same positions, and the rollback undoes both. Drafts past what the round verifies are
    not stored, so the draft never writes a position the verification does not rewrite.
    """

    exit_layer: int

    def check(self, target: DecoderModel) -> None:
        check_model(
            target, EarlyExitModel, "SelfSpeculation needs a target that can exit early; use PromptLookup or DraftModel"
        )
        layers = target.config.num_hidden_layers
        if not 1 <= self.exit_layer < layers:
            raise ValueError(
                f"SelfSpeculation: exit_layer must be in [1, {layers}) for this target, got {self.exit_layer}"
            )

    def propose(self, rnd: Round) -> Proposal:
        def forward(tokens, positions, cache):
            return rnd.target.early_exit(tokens, positions, cache, self.exit_layer)

        lengths = rnd.cache.lengths
        positions = jnp.where(rnd.running, lengths, -1)[:, None]
        last = latest_tokens(rnd.history, rnd.history_lengths)
        drafts, logits, cache = draft_tokens(
            forward, last[:, None], positions, rnd.cache, lengths + 1, rnd, write_until=lengths + rnd.num_verified
        )
        return Proposal(drafts, logits, rnd.draft_state, cache)


@pytree_class
class DraftState:
    """A draft model's carry: its cache and, per row, a kept draft it has not stored yet.

    The draft feeds ``x, d_1..d_{k-1}``; when all k drafts are kept, ``d_k`` is in the
    target's text but not in the draft cache, so it is fed first next round (``pending``,
    -1 when there is none): one 2-token step instead of an extra draft step.
    """

    cache: Any
    pending: jax.Array  # [B] int32


class DraftModel(Drafter):
    """A separate (smaller) draft model with the target's vocabulary and its own cache.

    Built from a ``DecoderModel`` (an ``nnx.Module``); equal (and hashed, for the
    compiled-code cache) by its graph definition, so its weights are ordinary inputs.
    """

    def __init__(self, model: DecoderModel):
        self.model = model
        self.graphdef, self.state = nnx.split(model)

    def __hash__(self):
        return hash(self.graphdef)

    def __eq__(self, other):
        return isinstance(other, DraftModel) and self.graphdef == other.graphdef

    def check(self, target: DecoderModel) -> None:
        check_model(self.model, DecoderModel, "a DraftModel decodes like its target")
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"DraftModel: the draft's vocabulary ({self.model.config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}); a draft model must share the target's tokenizer"
            )

    def params(self):
        return self.state

    def start(self, run: Prefilled, cache_source: CacheSource, reserve: int) -> DraftState:
        """Prefill the draft model's own cache (built like the target's) with the prompts."""
        batch = len(run.prompt_lengths)
        cache = cache_source.fresh(self.model, batch).reserve(reserve)
        _, cache = run.timings.prefill(prefill, {}, self.graphdef, self.state, cache, run.tokens, run.prompt_lengths)
        return DraftState(cache, jnp.full((batch,), -1, jnp.int32))

    def propose(self, rnd: Round) -> Proposal:
        model = nnx.merge(self.graphdef, rnd.draft_params)
        state: DraftState = rnd.draft_state
        lengths = rnd.cache.lengths  # the draft cache holds the same tokens, less a pending one
        pending = state.pending
        tokens = jnp.stack([jnp.maximum(pending, 0), latest_tokens(rnd.history, rnd.history_lengths)], axis=1)
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


def verify(
    target_logits, drafts, draft_logits, key, sampling: Sampling, num_checked=None
) -> tuple[jax.Array, jax.Array]:
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


@pytree_class
class SpeculativeCarry:
    """The speculative loop between rounds."""

    cache: Any  # the target's
    draft_state: Any  # the drafter's carry
    history: jax.Array  # [B, S] int32: each row's prompt, then its generated tokens
    history_lengths: jax.Array  # [B] int32: tokens of ``history`` in use (the latest is not in ``cache`` yet)
    num_generated: jax.Array  # [B] int32
    finish: jax.Array  # [B] int32 Finish
    key: jax.Array
    target_steps: jax.Array  # [B] int32: verification passes
    accepted: jax.Array  # [B] int32: drafts the target accepted


def appended(history: jax.Array, history_lengths: jax.Array, new: jax.Array, kept: jax.Array) -> jax.Array:
    """``history`` ``[B, S]`` with each row's first ``kept`` ``[B]`` of ``new`` ``[B, k+1]`` after its
    ``history_lengths`` ``[B]`` tokens."""
    offsets = jnp.arange(new.shape[1])[None, :]
    slots = jnp.where(offsets < kept[:, None], history_lengths[:, None] + offsets, history.shape[1])
    return history.at[jnp.arange(history.shape[0])[:, None], slots].set(new, mode="drop")


@dataclasses.dataclass(frozen=True)
class SpeculativeLoop:
    """The loop-invariant parts of ``speculative_decode`` and its rounds (traced, not a carry)."""

    target: DecoderModel
    draft_params: Any
    drafter: Drafter
    sampling: Sampling
    num_draft: int
    limits: Limits
    stream: Callable[[np.ndarray], None] | None

    @property
    def offsets(self) -> jax.Array:
        """``[1, k+1]``: a round's token offsets after a row's cached tokens."""
        return jnp.arange(self.num_draft + 1, dtype=jnp.int32)[None, :]

    def first_carry(self, cache, draft_state, history, prompt_lengths, first_logits, key) -> SpeculativeCarry:
        """Each row's first token, drawn from the prefill's ``first_logits`` ``[B, V]`` and put
        after its prompt in ``history`` ``[B, S]``."""
        batch = history.shape[0]
        first_key, key = jax.random.split(key)
        first = sample(first_logits, first_key, self.sampling)
        emit(self.stream, jnp.concatenate([first[:, None], jnp.full((batch, self.num_draft), -1, jnp.int32)], axis=1))
        num_generated, zeros = jnp.ones((batch,), jnp.int32), jnp.zeros((batch,), jnp.int32)
        return SpeculativeCarry(
            cache, draft_state, history.at[jnp.arange(batch), prompt_lengths].set(first), prompt_lengths + 1,
            num_generated, self.limits.finish(first, num_generated, cache.lengths), key, zeros, zeros,
        )  # fmt: skip

    def step(self, carry: SpeculativeCarry) -> SpeculativeCarry:
        """Draft, verify, keep, and roll the caches back past what the rows did not keep."""
        running = carry.finish == Finish.RUNNING
        key, draft_key, verify_key = jax.random.split(carry.key, 3)
        num_verified = self.verified_counts(carry.cache)
        proposal = self.drafter.propose(Round(
            self.target, carry.cache, self.draft_params, carry.draft_state, carry.history, carry.history_lengths,
            running, draft_key, self.sampling, self.num_draft, num_verified,
        ))  # fmt: skip
        num_accepted, new, cache = self.verified(carry, proposal, running, num_verified, verify_key)
        kept = self.kept_counts(new, num_accepted, carry, running)
        new = jnp.where(self.offsets < kept[:, None], new, -1)
        emit(self.stream, new)
        cache = cache.rollback(jnp.where(running, num_verified - kept, 0))
        num_generated = carry.num_generated + kept
        latest = jnp.take_along_axis(new, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
        return SpeculativeCarry(
            cache=cache,
            draft_state=self.drafter.commit(proposal.draft_state, proposal, kept, running),
            history=appended(carry.history, carry.history_lengths, new, kept),
            history_lengths=carry.history_lengths + kept,
            num_generated=num_generated,
            finish=jnp.where(running, self.limits.finish(latest, num_generated, cache.lengths), carry.finish),
            key=key,
            target_steps=carry.target_steps + running,
            accepted=carry.accepted + jnp.where(running, num_accepted, 0),
        )

    def verified_counts(self, cache) -> jax.Array:
        """``[B]`` tokens a round's verification writes: k + 1, fewer within ``exact_chunk_lengths``."""
        exact = cache.exact_chunk_lengths()
        everything = jnp.full((cache.batch_size,), self.num_draft + 1)
        return everything if exact is None else jnp.minimum(exact, self.num_draft + 1)

    def verified(self, carry: SpeculativeCarry, proposal: Proposal, running, num_verified, key):
        """The target's one pass over ``[x, d_1..d_k]`` at positions ``L..L+k`` (padding past
        ``num_verified``): accepted drafts ``[B]``, the round's tokens ``[B, k+1]`` (see
        ``verify``) and the target's cache holding them."""
        latest = latest_tokens(carry.history, carry.history_lengths)
        tokens = jnp.concatenate([latest[:, None], proposal.drafts], axis=1)
        written = running[:, None] & (self.offsets < num_verified[:, None])
        positions = jnp.where(written, carry.cache.lengths[:, None] + self.offsets, -1)
        logits, cache = self.target(tokens, positions, proposal.cache)
        num_accepted, new = verify(logits, proposal.drafts, proposal.logits, key, self.sampling, num_verified - 1)
        return num_accepted, new, cache

    def kept_counts(self, new, num_accepted, carry: SpeculativeCarry, running) -> jax.Array:
        """``[B]`` tokens each row keeps: its accepted drafts and the target's token, cut at a
        stop token, at ``max_new_tokens`` and at the capacity (a query past it missed its
        own key); 0 for stopped rows."""
        limits = self.limits
        kept = jnp.minimum(num_accepted + 1, limits.max_new_tokens - carry.num_generated)
        if limits.capacity is not None:
            kept = jnp.minimum(kept, limits.capacity - carry.cache.lengths)
        is_stop = jnp.isin(new, limits.stop_tokens) & (self.offsets < kept[:, None])
        kept = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, kept)
        return jnp.where(running, kept, 0)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "drafter", "sampling", "max_new_tokens", "num_draft", "stream"),
    donate_argnames=("cache", "draft_state", "history"),
)
def speculative_decode(
    graphdef, state, cache, draft_params, draft_state, history, prompt_lengths, first_logits, key, stop_tokens,
    *, drafter, sampling, max_new_tokens, num_draft, stream=None,
):  # fmt: skip
    """Decode speculatively until every row has stopped; returns the final ``SpeculativeCarry``.

    ``history`` ``[B, S]``: each row's prompt (``prompt_lengths`` ``[B]`` tokens, in
    ``cache``), ``first_logits`` ``[B, V]`` the prefill's. ``stream``, if given, receives
    each round's tokens ``[B, k+1]`` (-1 past what a row kept) through ``io_callback``.
    """
    limits = Limits(stop_tokens, max_new_tokens, cache.max_length)
    loop = SpeculativeLoop(nnx.merge(graphdef, state), draft_params, drafter, sampling, num_draft, limits, stream)
    carry = loop.first_carry(cache, draft_state, history, prompt_lengths, first_logits, key)
    return jax.lax.while_loop(lambda carry: jnp.any(carry.finish == Finish.RUNNING), loop.step, carry)


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


@dataclasses.dataclass(frozen=True)
class SpeculativeDecoding(Strategy):
    """``generate_speculative``'s strategy: ``drafter`` proposes ``num_draft`` (k) tokens a round."""

    request: Request
    drafter: Drafter
    num_draft: int

    @property
    def extra_slots(self) -> int:
        return self.num_draft + 1  # a verification writes up to k + 1 tokens past the kept ones

    def check(self, batch: Batch) -> None:
        budget = batch.cache.max_rollback
        if budget is not None and budget < self.num_draft:
            raise ValueError(
                f"this cache can undo {budget} tokens but a round may reject all {self.num_draft} drafts; "
                f"lower num_draft_tokens or use layers that can roll back further"
            )

    def start(self, run: Prefilled) -> Any:
        """The drafter's carry; a draft cache is built like the target's, as long as the run needs."""
        reserve = run.tokens.shape[1] + self.request.max_new_tokens + self.extra_slots
        source = self.request.cache_source
        draft_source = dataclasses.replace(source, max_length=source.max_length or bucket(reserve))
        return self.drafter.start(run, draft_source, reserve)

    def loop(self, run: Prefilled, started: Any) -> Loop:
        request = self.request
        history = np.zeros((len(run.prompt_lengths), run.tokens.shape[1] + request.max_new_tokens), np.int32)
        history[:, : run.tokens.shape[1]] = run.tokens
        args = (
            run.state, run.cache, self.drafter.params(), started, history, run.prompt_lengths, run.logits,
            request.key, request.stop_array,
        )  # fmt: skip
        static = {
            "sampling": request.sampling, "drafter": self.drafter, "max_new_tokens": request.max_new_tokens,
            "num_draft": self.num_draft, "stream": request.stream,
        }  # fmt: skip
        return Loop(speculative_decode, static, args)

    def result(self, carry: SpeculativeCarry, run: Prefilled) -> SpeculativeGeneration:
        history, counts = to_host(carry.history), to_host(carry.num_generated)
        generated = np.full((len(counts), self.request.max_new_tokens), -1, np.int32)
        for row, (begin, n) in enumerate(zip(run.prompt_lengths, counts)):
            generated[row, :n] = history[row, begin : begin + n]
        timings = run.timings
        return SpeculativeGeneration(
            generated, counts, [Finish(int(r)) for r in to_host(carry.finish)], timings.prefill_seconds,
            timings.loop_seconds, timings.compile_seconds, carry.cache.nbytes, carry.cache,
            target_steps=to_host(carry.target_steps), accepted=to_host(carry.accepted),
            num_draft_tokens=self.num_draft,
        )  # fmt: skip


def generate_speculative(
    model: DecoderModel,
    prompts: Sequence[Sequence[int]],
    *,
    drafter: Drafter,
    num_draft_tokens: int = 4,
    **options,
) -> SpeculativeGeneration:
    """``jaxkv.decoding.generate.generate`` with speculative decoding (see the module docstring).

    ``options``: ``generate``'s keywords but ``cache`` and ``encoder_inputs`` (a run starts
    from its prompts, on a decoder-only model). Same prompts, padding, cache building and
    finish reasons; greedy output is the same. ``num_draft_tokens`` (k) drafts per round;
    windowed cache layers get ``rollback_slots >= k``. ``stream(tokens [B, k+1])`` receives
    each round's tokens.
    """
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be at least 1, got {num_draft_tokens}")
    check_model(model, DecoderModel)
    drafter.check(model)
    request = Request.create(**options)
    source = request.cache_source
    if source.given is not None or request.encoder_inputs is not None or isinstance(model, EncoderDecoderModel):
        raise ValueError(
            "speculative decoding starts a decoder-only model from its prompts: drop cache= and encoder_inputs=, "
            "or use generate"
        )
    rollback_slots = max(source.settings.get("rollback_slots", 0), num_draft_tokens)
    request = dataclasses.replace(request, cache_source=source.with_settings(rollback_slots=rollback_slots))
    return drive(model, prompts, SpeculativeDecoding(request, drafter, num_draft_tokens))
