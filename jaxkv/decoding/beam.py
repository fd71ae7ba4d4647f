"""Jitted beam search: the prompt is prefilled once, then one compiled ``lax.while_loop``.

The selection rule is transformers' (v5, vectorised): each step every beam of a row
proposes its continuations, the top ``K = max(2, 1 + #stop tokens) * num_beams`` of the
``num_beams * V`` candidates are kept, those ending in a stop token (or at
``max_new_tokens``) compete for the ``num_beams`` finished hypotheses (scored
``sum log p / generated_length ** length_penalty``), and the best ``num_beams`` others keep
running. ``early_stopping``: True stops a row once it holds ``num_beams`` finished
hypotheses; False stops it once no running beam can beat the worst finished one at the
current length; ``"never"`` estimates that bound at ``max_new_tokens`` when
``length_penalty > 0`` (the canonical beam search).

The search is model- and cache-agnostic: the loop needs only ``model(tokens [N, 1],
positions [N, 1], cache) -> (logits [N, 1, V], cache)`` and ``cache.repeat`` /
``cache.reorder`` / ``cache.lengths`` (preparing the batch also reads ``batch_size``,
``max_length`` and calls ``reserve``). The prompt's cache (``B`` rows) is repeated to
``B * num_beams`` rows once, in the compiled search before its loop, and reordered
in-graph every step by ``reorder``, which gathers every leaf: any cache type works,
quantized or encoder-decoder included.
Prompts of a batch may differ in length; each row is searched independently.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxkv.decoding.generate import compiled, prepare_batch, prompt_logits

# transformers' "impossible" score: a candidate that must not be chosen gets this added.
NEG = -1.0e9


@dataclasses.dataclass(frozen=True)
class BeamSettings:
    """Beam search parameters, with transformers' meanings (see the module docstring)."""

    num_beams: int
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    num_return_sequences: int = 1

    def __post_init__(self):
        if self.num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {self.num_beams}")
        if not 1 <= self.num_return_sequences <= self.num_beams:
            raise ValueError(
                f"num_return_sequences must be in [1, num_beams={self.num_beams}], got {self.num_return_sequences}"
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


class BeamState(struct.PyTreeNode):
    """The search between steps, per prompt row ``B`` and beam ``N = num_beams``.

    ``running_*``: the beams still extended; ``finished_*``: the best finished hypotheses
    so far, best first (score ``NEG`` where none). Token buffers are ``[B, N, max_new]``.
    """

    running_tokens: jax.Array  # [B, N, max_new] int32
    running_scores: jax.Array  # [B, N] float32: summed log-probabilities
    parents: jax.Array  # [B, N] int32: the beam each running beam extended this step
    finished_tokens: jax.Array  # [B, N, max_new] int32
    finished_scores: jax.Array  # [B, N] float32: length-penalised
    finished_lengths: jax.Array  # [B, N] int32
    is_finished: jax.Array  # [B, N] bool
    improvable: jax.Array  # [B] bool: may a running beam still beat the finished ones?
    all_stopped: jax.Array  # bool: every candidate of the last step hit a stop
    step: jax.Array  # int32: tokens generated so far


def gather_beams(x: jax.Array, indices: jax.Array) -> jax.Array:
    """``x`` ``[B, M, ...]`` at ``indices`` ``[B, K]`` along the beam axis -> ``[B, K, ...]``."""
    return jax.vmap(lambda row, idx: row[idx])(x, indices)


def initial_state(batch: int, num_beams: int, max_new_tokens: int) -> BeamState:
    """Only beam 0 is live at first (the others score ``NEG``), so the first step does not
    pick the same token from ``num_beams`` identical beams."""
    tokens = jnp.full((batch, num_beams, max_new_tokens), -1, jnp.int32)
    return BeamState(
        running_tokens=tokens,
        running_scores=jnp.zeros((batch, num_beams), jnp.float32).at[:, 1:].set(NEG),
        parents=jnp.zeros((batch, num_beams), jnp.int32),
        finished_tokens=tokens,
        finished_scores=jnp.full((batch, num_beams), NEG, jnp.float32),
        finished_lengths=jnp.zeros((batch, num_beams), jnp.int32),
        is_finished=jnp.zeros((batch, num_beams), bool),
        improvable=jnp.ones((batch,), bool),
        all_stopped=jnp.bool_(False),
        step=jnp.int32(0),
    )


def length_penalties(max_new_tokens: int, length_penalty: float) -> jax.Array:
    """``[max_new]`` float32: entry n - 1 is ``n ** length_penalty`` for n generated tokens,
    computed in float64 and rounded once, as transformers does with Python floats."""
    return jnp.asarray(np.arange(1, max_new_tokens + 1, dtype=np.float64) ** length_penalty, jnp.float32)


def select(state: BeamState, logits: jax.Array, stop_tokens: jax.Array, settings: BeamSettings, num_stop: int):
    """One beam step from the running beams' next-token ``logits`` ``[B, N, V]``."""
    batch, num_beams, vocab = logits.shape
    max_new = state.running_tokens.shape[-1]
    keep = min(max(2, 1 + num_stop) * num_beams, num_beams * vocab)
    penalty = length_penalties(max_new, settings.length_penalty)
    step = state.step

    totals = jax.nn.log_softmax(logits, axis=-1) + state.running_scores[:, :, None]
    top_scores, top_index = jax.lax.top_k(totals.reshape(batch, num_beams * vocab), keep)  # [B, K]
    source, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
    candidates = gather_beams(state.running_tokens, source).at[:, :, step].set(token)  # [B, K, max_new]
    stopped = jnp.isin(token, stop_tokens) | (step + 1 >= max_new)

    # The best candidates that did not stop keep running.
    running_pick = top_scores + stopped.astype(jnp.float32) * NEG
    best = jax.lax.top_k(running_pick, num_beams)[1]
    running_tokens = gather_beams(candidates, best)
    running_scores = gather_beams(running_pick, best)
    parents = gather_beams(source, best)

    # Stopped candidates among the top num_beams compete with the finished hypotheses.
    finished_now = stopped & (jnp.arange(keep) < num_beams)[None, :]
    scores = top_scores / penalty[step]
    if settings.early_stopping is True:
        scores += jnp.all(state.is_finished, axis=-1, keepdims=True).astype(jnp.float32) * NEG
    scores += (~state.improvable[:, None]).astype(jnp.float32) * NEG
    scores += (~finished_now).astype(jnp.float32) * NEG
    merged_scores = jnp.concatenate([state.finished_scores, scores], axis=1)
    keep_finished = jax.lax.top_k(merged_scores, num_beams)[1]
    finished_tokens = gather_beams(jnp.concatenate([state.finished_tokens, candidates], axis=1), keep_finished)
    new_lengths = jnp.full((batch, keep), step + 1, jnp.int32)
    finished_lengths = gather_beams(jnp.concatenate([state.finished_lengths, new_lengths], axis=1), keep_finished)
    is_finished = gather_beams(jnp.concatenate([state.is_finished, finished_now], axis=1), keep_finished)
    finished_scores = gather_beams(merged_scores, keep_finished)

    # Can the best running beam still beat the worst finished hypothesis?
    step = step + 1
    bound_length = max_new if settings.early_stopping == "never" and settings.length_penalty > 0 else step
    best_possible = running_scores[:, :1] / penalty[bound_length - 1]
    worst = jnp.where(is_finished, jnp.min(finished_scores, axis=1, keepdims=True), NEG)
    improvable = state.improvable & jnp.any(best_possible > worst, axis=1)
    return BeamState(
        running_tokens, running_scores, parents, finished_tokens, finished_scores, finished_lengths,
        is_finished, improvable, jnp.all(stopped), step,
    )  # fmt: skip


def searching(state: BeamState, settings: BeamSettings) -> jax.Array:
    """Whether another step may change a result (transformers' stopping rule)."""
    open_beams = ~(jnp.all(state.is_finished) & (settings.early_stopping is True))
    return jnp.any(state.improvable) & open_beams & ~state.all_stopped


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "num_stop", "max_new_tokens"))
def search(graphdef, state, cache, first_logits, stop_tokens, *, settings: BeamSettings, num_stop, max_new_tokens):
    """Beam search from the prompts' cache (``B`` rows) and their next-token logits ``[B, V]``.

    Repeats the cache to ``B * num_beams`` rows, then runs one ``lax.while_loop`` whose
    body reorders the cache to the surviving beams' parents, feeds their newest tokens
    and selects. Returns the final ``BeamState`` and cache.
    """
    model = nnx.merge(graphdef, state)
    batch, num_beams = first_logits.shape[0], settings.num_beams
    cache = cache.repeat(num_beams)
    beams = initial_state(batch, num_beams, max_new_tokens)
    logits = jnp.broadcast_to(first_logits[:, None], (batch, num_beams, first_logits.shape[-1]))
    beams = select(beams, logits, stop_tokens, settings, num_stop)
    row_offsets = jnp.arange(batch, dtype=jnp.int32)[:, None] * num_beams

    def body(carry):
        beams, cache = carry
        cache = cache.reorder((beams.parents + row_offsets).reshape(-1))
        newest = beams.running_tokens[:, :, beams.step - 1].reshape(-1, 1)
        logits, cache = model(newest, cache.lengths[:, None], cache)
        logits = logits[:, -1].reshape(batch, num_beams, -1)
        return select(beams, logits, stop_tokens, settings, num_stop), cache

    return jax.lax.while_loop(lambda carry: searching(carry[0], settings), body, (beams, cache))


def _prefill_logits(graphdef, state, cache, tokens, prompt_lengths):
    """The prompts' next-token logits ``[B, V]`` and their cache (prefilled once per prompt)."""
    return prompt_logits(nnx.merge(graphdef, state), cache, tokens, prompt_lengths)


prefill_logits = jax.jit(_prefill_logits, static_argnames=("graphdef",), donate_argnames=("cache",))
prefill_logits_shared = jax.jit(_prefill_logits, static_argnames=("graphdef",))  # keeps a caller's cache valid


@dataclasses.dataclass
class BeamGeneration:
    """Best hypotheses first: ``tokens`` ``[B, R, max_new]`` (-1 past each one's length),
    ``lengths`` ``[B, R]`` and length-penalised ``scores`` ``[B, R]``, R = num_return_sequences."""

    tokens: np.ndarray
    lengths: np.ndarray
    scores: np.ndarray
    prefill_seconds: float
    search_seconds: float
    compile_seconds: float
    cache_bytes: int

    def sequence(self, row: int, rank: int = 0) -> list[int]:
        """Generated tokens of hypothesis ``rank`` (0 = best) of prompt ``row``."""
        return self.tokens[row, rank, : self.lengths[row, rank]].tolist()


def beam_search(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    num_beams: int,
    length_penalty: float = 1.0,
    early_stopping: bool | Literal["never"] = False,
    num_return_sequences: int = 1,
    stop_tokens: Sequence[int] = (),
    cache=None,
    cache_kind: str = "static",
    max_length: int | None = None,
    **cache_kwargs,
) -> BeamGeneration:
    """Beam search over each prompt (token ids) of a ragged batch; see the module docstring.

    Prompts and cache are prepared as ``generate`` does (``jaxkv.decoding.generate.prepare_batch``:
    bucketed widths, a fresh cache or ``cache`` to continue). A hypothesis ends at a stop
    token (included in its tokens) or at ``max_new_tokens``. A cache too small to hold
    ``max_new_tokens`` more per beam is refused, so no beam is ever cut short by it.
    """
    settings = BeamSettings(num_beams, length_penalty, early_stopping, num_return_sequences)
    given_cache = cache is not None  # the caller's: never donated
    tokens, lengths, cache = prepare_batch(
        model, prompts, max_new_tokens=max_new_tokens, cache=cache, cache_kind=cache_kind, max_length=max_length,
        **cache_kwargs,
    )  # fmt: skip
    capacity, longest = cache.max_length, int(np.max(np.asarray(cache.lengths) + lengths))
    if capacity is not None and longest + max_new_tokens - 1 > capacity:  # a beam would lose tokens silently
        raise ValueError(
            f"beam search writes up to {longest + max_new_tokens - 1} tokens per row but the cache holds {capacity}; "
            f"raise max_length or lower max_new_tokens"
        )
    stops = sorted(set(stop_tokens))
    stop_array = jnp.asarray(stops or [-2], jnp.int32)
    graphdef, state = nnx.split(model)
    prefill_fn = prefill_logits_shared if given_cache else prefill_logits
    prefill_c, prefill_compile = compiled(prefill_fn, {}, graphdef, state, cache, tokens, lengths)
    start = time.perf_counter()
    logits, cache = prefill_c(state, cache, tokens, lengths)
    logits.block_until_ready()
    prefill_seconds = time.perf_counter() - start

    static = {"settings": settings, "num_stop": len(stops), "max_new_tokens": max_new_tokens}
    search_c, search_compile = compiled(search, static, graphdef, state, cache, logits, stop_array)
    start = time.perf_counter()
    beams, cache = search_c(state, cache, logits, stop_array)
    out = jax.device_get(beams)
    search_seconds = time.perf_counter() - start

    keep = slice(0, num_return_sequences)
    lengths_out = out.finished_lengths[:, keep]
    tokens_out = np.where(
        np.arange(max_new_tokens)[None, None, :] < lengths_out[:, :, None], out.finished_tokens[:, keep], -1
    )
    return BeamGeneration(
        tokens_out, lengths_out, out.finished_scores[:, keep], prefill_seconds, search_seconds,
        prefill_compile + search_compile, cache.nbytes,
    )  # fmt: skip
