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

The search runs on the decoding driver (``jaxkv.decoding.driver``: batch, prefill, timing)
and is model- and cache-agnostic: the loop needs only ``model(tokens [N, 1], positions
[N, 1], cache) -> (logits [N, 1, V], cache)`` and ``cache.repeat`` / ``cache.reorder`` /
``cache.lengths``. The prompt's cache (``B`` rows) is repeated to
``B * num_beams`` rows once, in the compiled search before its loop, and reordered
in-graph every step by ``reorder``, which gathers every leaf: any cache type works,
quantized or encoder-decoder included.
Prompts of a batch may differ in length; each row is searched independently.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.decoding.driver import Batch, Loop, Prefilled, Request, Strategy, drive
from jaxkv.decoding.model import DecoderModel
from jaxkv.decoding.sampling import GREEDY
from jaxkv.protocol import pytree_class
from jaxkv.sharding import to_host

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


@pytree_class
class BeamState:
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


@pytree_class
class BeamCarry:
    """The search loop between steps: the beams and their cache (``B * num_beams`` rows)."""

    beams: BeamState
    cache: Any


@functools.partial(jax.jit, static_argnames=("graphdef", "settings", "num_stop", "max_new_tokens"))
def search(graphdef, state, cache, first_logits, stop_tokens, *, settings: BeamSettings, num_stop, max_new_tokens):
    """Beam search from the prompts' cache (``B`` rows) and their next-token logits ``[B, V]``.

    Repeats the cache to ``B * num_beams`` rows, then runs one ``lax.while_loop`` whose
    body reorders the cache to the surviving beams' parents, feeds their newest tokens
    and selects. Returns the final ``BeamCarry``.
    """
    model = nnx.merge(graphdef, state)
    batch, num_beams = first_logits.shape[0], settings.num_beams
    beams = initial_state(batch, num_beams, max_new_tokens)
    logits = jnp.broadcast_to(first_logits[:, None], (batch, num_beams, first_logits.shape[-1]))
    carry = BeamCarry(select(beams, logits, stop_tokens, settings, num_stop), cache.repeat(num_beams))

    def step(carry: BeamCarry) -> BeamCarry:
        beams = carry.beams
        cache = carry.cache.reorder_in_groups(beams.parents)  # a prompt's beams stay on its devices
        newest = beams.running_tokens[:, :, beams.step - 1].reshape(-1, 1)
        logits, cache = model(newest, cache.lengths[:, None], cache)
        logits = logits[:, -1].reshape(batch, num_beams, -1)
        return BeamCarry(select(beams, logits, stop_tokens, settings, num_stop), cache)

    return jax.lax.while_loop(lambda carry: searching(carry.beams, settings), step, carry)


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


@dataclasses.dataclass(frozen=True)
class BeamSearch(Strategy):
    """``beam_search``'s strategy: the whole search in one compiled loop."""

    request: Request
    settings: BeamSettings

    def check(self, batch: Batch) -> None:
        """A cache too small to hold ``max_new_tokens`` more per beam would cut a beam short silently."""
        capacity, written = batch.cache.max_length, self.request.max_new_tokens - 1
        longest = int(np.max(to_host(batch.cache.lengths) + batch.prompt_lengths))
        if capacity is not None and longest + written > capacity:
            raise ValueError(
                f"beam search writes up to {longest + written} tokens per row but the cache holds {capacity}; "
                f"raise max_length or lower max_new_tokens"
            )

    def loop(self, run: Prefilled, started: None) -> Loop:
        request = self.request
        static = {
            "settings": self.settings, "num_stop": len(request.stop_tokens), "max_new_tokens": request.max_new_tokens
        }  # fmt: skip
        return Loop(search, static, (run.state, run.cache, run.logits, request.stop_array))

    def result(self, carry: BeamCarry, run: Prefilled) -> BeamGeneration:
        beams = jax.tree.map(to_host, carry.beams)
        keep = slice(0, self.settings.num_return_sequences)
        lengths = beams.finished_lengths[:, keep]
        generated = np.arange(self.request.max_new_tokens)[None, None, :] < lengths[:, :, None]
        tokens = np.where(generated, beams.finished_tokens[:, keep], -1)
        timings = run.timings
        return BeamGeneration(
            tokens, lengths, beams.finished_scores[:, keep], timings.prefill_seconds, timings.loop_seconds,
            timings.compile_seconds, carry.cache.nbytes,
        )  # fmt: skip


def beam_search(
    model: DecoderModel,
    prompts: Sequence[Sequence[int]],
    *,
    num_beams: int,
    length_penalty: float = 1.0,
    early_stopping: bool | Literal["never"] = False,
    num_return_sequences: int = 1,
    **options,
) -> BeamGeneration:
    """Beam search over each prompt (token ids) of a ragged batch; see the module docstring.

    ``options``: the keywords of ``jaxkv.decoding.driver.Request.create`` but ``sampling``,
    ``seed`` and ``stream`` (the search is deterministic and returns whole hypotheses):
    ``max_new_tokens``, ``stop_tokens``, ``encoder_inputs``, ``cache`` to continue, or
    ``full_attention``, ``max_length`` and cache settings to build one. A hypothesis ends
    at a stop token (included in its tokens) or at ``max_new_tokens``. A cache too small to
    hold ``max_new_tokens`` more per beam is refused, so no beam is ever cut short by it.
    """
    settings = BeamSettings(num_beams, length_penalty, early_stopping, num_return_sequences)
    request = Request.create(**options)
    if (request.sampling, request.seed, request.stream) != (GREEDY, 0, None):
        raise ValueError("beam search is deterministic and returns whole hypotheses: drop sampling, seed and stream")
    return drive(model, prompts, BeamSearch(request, settings))
