"""The draft-model proposer: a smaller model with the target's vocabulary drafts greedily for the
engine's decoding rows (``SpeculativeConfig(method="draft")``).

Where the draft's K/V live: a dense per-row cache of the draft model of its own
(``draft_model.init_cache(num_rows, max_model_len)``, full attention, one cache row per engine
row ``seq.row``), not pages in the engine's page manager. Why:

- the draft's layers, heads and head size differ from the target's, so its K/V cannot live in
  the target's pools; a pool of its own in the page manager would bring allocation, preemption,
  swapping and prefix hashing for K/V that is cheap to recompute;
- what a row holds is a function of the tokens fed to it, kept on the host (``fed``): a
  sequence that is preempted, swapped, forked or recomputed just catches up from the longest
  prefix its row still holds, and the prefix cache keeps hashing target pages only;
- a dense full-attention row undoes any number of tokens (``Cache.rollback`` with per-row
  counts), which a draft needs after every verification and whenever a row changes hands.

The cost: ``num_rows * max_model_len`` positions of the draft's K/V are reserved up front
(``cache.nbytes``; SmolLM2-135M in bfloat16 takes 22.5 KiB a position), and a new prompt is
prefilled by the draft even where the target's prefix cache had it.

Each ``propose`` call, for every sequence with a positive limit: its row is cut back to the
longest common prefix of what the row was fed and the sequence's tokens (but at least the last
token is fed again, whose logits give the first draft), fed the rest (the catch-up: one token
or two after a verification, a whole prompt for a new sequence), then ``limit`` drafts are
drawn by argmax, each fed to draw the next. All rows run in one compiled call, padded to a
catch-up width bucket (``catch_up_widths``); a catch-up longer than ``chunk_size`` feeds its
first full chunks in calls of their own first. Rows that do not propose get padding (position
-1) and are left as they were. A row never holds more than ``max_model_len`` positions: drafts
stop at the model's length. Drafts are greedy, so the engine's verification treats each as a
one-hot proposal (exact for sampled requests too, see ``jaxkv.serving.speculation``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.decoding.model import DecoderModel, check_model
from jaxkv.serving.requests import SequenceState
from jaxkv.serving.speculation import MAX_NUM_TOKENS, Proposer

# The narrowest catch-up bucket: after a row kept all its drafts, the last draft (drawn, never
# fed) and the target's token.
MIN_WIDTH = 2
DEFAULT_CHUNK_SIZE = 128


def catch_up_widths(chunk_size: int) -> tuple[int, ...]:
    """Widths a proposing call's catch-up is padded to: powers of two from ``MIN_WIDTH`` below
    ``chunk_size``, then ``chunk_size`` (one compiled call each)."""
    widths, width = [], MIN_WIDTH
    while width < chunk_size:
        widths.append(width)
        width *= 2
    return (*widths, chunk_size)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of token arrays ``a`` and ``b``."""
    size = min(len(a), len(b))
    differ = np.flatnonzero(a[:size] != b[:size])
    return int(differ[0]) if differ.size else size


def catch_up_pieces(tokens: np.ndarray, start: int, chunk_size: int) -> list[tuple[int, np.ndarray]]:
    """``tokens[start:]`` (at least one token) as ``(position, piece)``: full chunks of
    ``chunk_size`` tokens, then a last piece of 1 to ``chunk_size`` tokens."""
    last = (len(tokens) - start - 1) % chunk_size + 1
    bounds = [*range(start, len(tokens) - last, chunk_size), len(tokens) - last, len(tokens)]
    return [(begin, tokens[begin:end]) for begin, end in itertools.pairwise(bounds)]


class DraftProposer(Proposer):
    """Greedy drafts from ``draft_model`` (a ``DecoderModel`` with the target's vocabulary; the
    engine checks the vocabulary) for up to ``num_rows`` engine rows, ``num_tokens`` (k) at most
    per sequence and step, sequences of up to ``max_model_len`` tokens; ``chunk_size``: the most
    catch-up tokens of a row fed in one call. See the module docstring.

    State: ``cache`` (the draft's, ``[num_rows]`` rows of ``max_model_len`` positions), per row
    the tokens it holds (``fed``) and the sequence that holds it, and ``executables`` (one
    compiled call per catch-up width, one for full chunks)."""

    def __init__(
        self, draft_model, *, num_rows: int, max_model_len: int, num_tokens: int, chunk_size: int = DEFAULT_CHUNK_SIZE
    ):
        check_model(draft_model, DecoderModel, "a draft model decodes like its target")
        for name, value in (("num_rows", num_rows), ("max_model_len", max_model_len), ("chunk_size", chunk_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DraftProposer: {name} must be a positive int, got {value!r}")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= MAX_NUM_TOKENS:
            raise ValueError(f"DraftProposer: num_tokens must be an int in [1, {MAX_NUM_TOKENS}], got {num_tokens!r}")
        if max_model_len > draft_model.config.max_position_embeddings:
            raise ValueError(
                f"DraftProposer: max_model_len {max_model_len} exceeds the draft model's max_position_embeddings "
                f"({draft_model.config.max_position_embeddings})"
            )
        cache = draft_model.init_cache(num_rows, max_model_len)
        if cache.max_rollback is not None:
            raise ValueError(
                f"DraftProposer: the draft_model's cache can undo only {cache.max_rollback} tokens (a sliding-window "
                f"or recurrent layer), but a draft row is cut back to any position; use a full-attention draft model"
            )
        self.graphdef, self.state = nnx.split(draft_model)
        self.cache = cache
        self.num_rows, self.max_model_len = num_rows, max_model_len
        self.num_tokens, self.chunk_size = num_tokens, chunk_size
        self.widths = catch_up_widths(chunk_size)
        self.executables: dict[tuple[str, int], Callable] = {}
        self.fed = [np.zeros(0, np.int32) for _ in range(num_rows)]  # tokens row r's cache holds, in order
        self.holders: list[tuple[int, int] | None] = [None] * num_rows  # the key of the sequence on each row

    @property
    def num_compiled(self) -> int:
        return len(self.executables)

    def propose(self, seqs: Sequence[SequenceState], limits: Sequence[int]) -> list[list[int]]:
        limits = [self._limit(seq, limit) for seq, limit in zip(seqs, limits, strict=True)]
        drafting = [(seq, limit) for seq, limit in zip(seqs, limits) if limit]
        if not drafting:
            return [[] for _ in seqs]
        rows = [seq.row for seq, _ in drafting]
        if len(set(rows)) < len(rows):
            raise ValueError(f"DraftProposer.propose: seqs share rows {sorted(rows)}; each row holds one sequence")
        tokens = {seq.row: np.asarray(seq.tokens, np.int32) for seq, _ in drafting}
        num_drafts = np.zeros(self.num_rows, np.int32)
        num_drafts[rows] = [limit for _, limit in drafting]
        drafts = self._drafted(tokens, num_drafts)
        for seq, limit in drafting:
            self.fed[seq.row] = np.concatenate([tokens[seq.row], drafts[seq.row, : limit - 1]])
            self.holders[seq.row] = seq.key
        return [drafts[seq.row, :limit].tolist() if limit else [] for seq, limit in zip(seqs, limits)]

    def release(self, seq: SequenceState) -> None:
        for row, key in enumerate(self.holders):
            if key == seq.key:
                self.fed[row], self.holders[row] = np.zeros(0, np.int32), None

    def warmup(self) -> None:
        """Compile every call (the full-chunk feed and each catch-up width), so no step waits for one."""
        self._executable("feed", self.chunk_size)
        for width in self.widths:
            self._executable("propose", width)

    def _limit(self, seq: SequenceState, limit: int) -> int:
        """``limit`` checked against ``seq`` (on a row of this proposer, within the model's length),
        cut so that no draft lands at ``max_model_len`` or past it."""
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or not 0 <= limit <= self.num_tokens:
            raise ValueError(f"DraftProposer.propose: limits must be ints in [0, {self.num_tokens}], got {limit!r}")
        if seq.row is None or not 0 <= seq.row < self.num_rows:
            raise ValueError(
                f"DraftProposer.propose: seqs must run on a row in [0, {self.num_rows}), got row {seq.row} "
                f"for sequence {seq.key}"
            )
        if seq.num_tokens > self.max_model_len:
            raise ValueError(
                f"DraftProposer.propose: sequence {seq.key} has {seq.num_tokens} tokens, past max_model_len "
                f"{self.max_model_len}"
            )
        return min(int(limit), self.max_model_len - seq.num_tokens)

    def _drafted(self, tokens: dict[int, np.ndarray], num_drafts: np.ndarray) -> np.ndarray:
        """Drafts ``[R, k]`` (a row's first ``num_drafts[row]`` are its): each row of ``tokens``
        (its sequence's tokens) cut to the longest prefix it holds (less the last token, whose
        logits give the first draft) and caught up: full chunks first, then the last piece and
        the drafts in one call."""
        pieces = {
            row: catch_up_pieces(held, min(common_prefix(self.fed[row], held), len(held) - 1), self.chunk_size)
            for row, held in tokens.items()
        }
        size = self.chunk_size
        for j in range(max(len(found) for found in pieces.values()) - 1):
            chunks = {row: found[j] for row, found in pieces.items() if j < len(found) - 1}
            self.cache = self._executable("feed", size)(self.state, self.cache, *self._inputs(chunks, size))
        last = {row: found[-1] for row, found in pieces.items()}
        width = next(w for w in self.widths if w >= max(len(piece) for _, piece in last.values()))
        drafts, self.cache = self._executable("propose", width)(
            self.state, self.cache, *self._inputs(last, width), num_drafts
        )
        return np.asarray(jax.device_get(drafts))

    def _inputs(self, pieces: dict[int, tuple[int, np.ndarray]], width: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens and positions ``[R, width]``: row r's piece ``(start, tokens)`` at positions
        ``start ..``, right-padded (position -1); rows without a piece all padding."""
        tokens, positions = np.zeros((self.num_rows, width), np.int32), np.full((self.num_rows, width), -1, np.int32)
        for row, (start, piece) in pieces.items():
            tokens[row, : len(piece)] = piece
            positions[row, : len(piece)] = np.arange(start, start + len(piece))
        return tokens, positions

    def _executable(self, kind: str, width: int) -> Callable:
        """The compiled ``kind`` call ('feed' or 'propose') for catch-ups ``width`` tokens wide."""
        if (kind, width) not in self.executables:
            shape = np.zeros((self.num_rows, width), np.int32)
            if kind == "feed":
                lowered = _fed.lower(self.graphdef, self.state, self.cache, shape, shape)
            else:
                rows = np.zeros(self.num_rows, np.int32)
                lowered = _drafts.lower(self.graphdef, self.state, self.cache, shape, shape, rows, self.num_tokens)
            self.executables[kind, width] = lowered.compile()
        return self.executables[kind, width]


def _feed(model, cache, tokens: jax.Array, positions: jax.Array):
    """Each row with tokens in ``tokens`` ``[R, T]`` (right-padded, ``positions`` -1) cut back to
    its first position, then fed: the logits ``[R, 1, V]`` at each row's last token, and the cache."""
    first = positions[:, 0]
    cache = cache.rollback(jnp.where(first >= 0, cache.lengths - first, 0))
    last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0)
    return model(tokens, positions, cache, logits_index=last)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _fed(graphdef, state, cache, tokens: jax.Array, positions: jax.Array):
    """``_feed``'s cache: a catch-up chunk that draws nothing."""
    return _feed(nnx.merge(graphdef, state), cache, tokens, positions)[1]


@functools.partial(jax.jit, static_argnames=("graphdef", "num_tokens"), donate_argnames=("cache",))
def _drafts(graphdef, state, cache, tokens: jax.Array, positions: jax.Array, num_drafts: jax.Array, num_tokens: int):
    """``_feed``, then ``num_tokens`` (k) greedy drafts per row ``[R, k]``: draft j + 1 is drawn
    after draft j is fed, and a row stores its first ``num_drafts[r] - 1`` drafts only (a row
    with none stores nothing; its later drafts are drawn from padding, unused)."""
    model = nnx.merge(graphdef, state)
    logits, cache = _feed(model, cache, tokens, positions)
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    next_position = jnp.max(positions, axis=1) + 1  # the first draft's
    stored_before = next_position + num_drafts - 1

    def step(carry, _):
        token, position, cache = carry
        logits, cache = model(token[:, None], jnp.where(position < stored_before, position, -1)[:, None], cache)
        new = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        return (new, position + 1, cache), new

    (_, _, cache), rest = jax.lax.scan(step, (first, next_position, cache), length=num_tokens - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1), cache
