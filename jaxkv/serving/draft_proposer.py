"""The draft-model proposer: a smaller model with the target's vocabulary drafts greedily for the
engine's decoding rows (``SpeculativeConfig(method="draft")``).

Where the draft's K/V live: pages of a pool of the draft model's own (``draft_model.init_cache``
with ``Paging``: full-attention paged layers), each engine row owning a fixed run of pages for
``max_model_len`` positions (a static block table: no page manager, nothing to allocate), not
pages in the engine's page manager. Why:

- the draft's layers, heads and head size differ from the target's, so its K/V cannot live in
  the target's pools; a pool of its own in the page manager would bring allocation, preemption,
  swapping and prefix hashing for K/V that is cheap to recompute;
- what a row holds is a function of the tokens fed to it, kept on the host (``fed``): a
  sequence that is preempted, swapped, forked or recomputed just catches up from the longest
  prefix its row still holds, and the prefix cache keeps hashing target pages only;
- paged K/V are masked by absolute position, so a row is "cut back" by writing over it from the
  position where it differs (nothing to roll back), and a call runs the packed tokens of the
  rows that propose only: its cost follows those rows, not the engine's ``num_rows``.

The cost: ``num_rows * max_model_len`` positions of the draft's K/V are reserved up front
(``cache.nbytes``; SmolLM2-135M in bfloat16 takes 22.5 KiB a position), and a new prompt is
prefilled by the draft even where the target's prefix cache had it.

Each ``propose`` call, for every sequence with a positive limit: its row is fed again from the
longest common prefix of what the row was fed and the sequence's tokens (but at least the last
token, whose logits give the first draft: the catch-up, one token or two after a
verification, a whole prompt for a new sequence), then ``limit`` drafts are drawn by argmax,
each fed to draw the next. The proposing rows run in one compiled call, their number padded to
a row bucket (``row_buckets``) and their catch-ups to a width bucket (``catch_up_widths``); a
catch-up longer than ``chunk_size`` feeds its first full chunks in calls of their own first.
Rows that do not propose are left as they were. A row never holds more than ``max_model_len``
positions: drafts stop at the model's length. Drafts are greedy, so the engine's verification
treats each as a one-hot proposal (exact for sampled requests too, see
``jaxkv.serving.speculation``).

What a call costs (``cost``, for the engine's rule): ``warmup`` times one row's full chunk (the
seconds a fed token takes) and one row's drafting call; a call's prediction is linear in the slots
it runs (``rows * width``, plus ``rows`` per draft after the first), scaled by the running ratio
of measured to predicted calls.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.batch import PackedBatch, PagedStorage
from jaxkv.decoding.model import DecoderModel, check_model
from jaxkv.layers.paged import FULL_POOL, NULL_PAGE, Paging, table_width
from jaxkv.protocol import has
from jaxkv.serving.requests import SequenceState
from jaxkv.serving.speculation import MAX_NUM_TOKENS, Proposer, running_mean

# The narrowest catch-up bucket: after a row kept all its drafts, the last draft (drawn, never
# fed) and the target's token.
MIN_WIDTH = 2
DEFAULT_CHUNK_SIZE = 128
DEFAULT_PAGE_SIZE = 16
# Buckets grow by this factor (rows and catch-up widths): fewer compiles, at most 4x padding.
BUCKET_GROWTH = 4


def _buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """``smallest`` times powers of ``BUCKET_GROWTH`` below ``largest``, then ``largest``."""
    sizes, size = [], smallest
    while size < largest:
        sizes.append(size)
        size *= BUCKET_GROWTH
    return (*sizes, largest)


def catch_up_widths(chunk_size: int) -> tuple[int, ...]:
    """Widths a proposing call's catch-up is padded to: ``MIN_WIDTH`` times powers of
    ``BUCKET_GROWTH`` below ``chunk_size``, then ``chunk_size`` (one compiled call each)."""
    return _buckets(MIN_WIDTH, chunk_size)


def row_buckets(num_rows: int) -> tuple[int, ...]:
    """Row counts a call's proposing rows are padded to: 1 times powers of ``BUCKET_GROWTH``
    below ``num_rows``, then ``num_rows``."""
    return _buckets(1, num_rows)


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


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DraftProposer: {name} must be a positive int, got {value!r}")


class DraftProposer(Proposer):
    """Greedy drafts from ``draft_model`` (a ``DecoderModel`` with the target's vocabulary; the
    engine checks the vocabulary) for up to ``num_rows`` engine rows, ``num_tokens`` (k) at most
    per sequence and step, sequences of up to ``max_model_len`` tokens; ``chunk_size``: the most
    catch-up tokens of a row fed in one call; ``page_size``: slots of a page of the draft's pool.
    See the module docstring.

    State: ``cache`` (the draft's paged layers), ``block_tables`` (``{'full': [num_rows, C]}``,
    fixed: row r's pages), per row the tokens it holds (``fed``) and the sequence that holds it,
    and ``executables`` (one compiled call per row bucket and catch-up width, and per row bucket
    for full chunks)."""

    def __init__(
        self, draft_model, *, num_rows: int, max_model_len: int, num_tokens: int, chunk_size: int = DEFAULT_CHUNK_SIZE,
        page_size: int = DEFAULT_PAGE_SIZE,
    ):  # fmt: skip
        check_model(draft_model, DecoderModel, "a draft model decodes like its target")
        for name, value in (
            ("num_rows", num_rows), ("max_model_len", max_model_len), ("chunk_size", chunk_size),
            ("page_size", page_size),
        ):  # fmt: skip
            _check_positive(name, value)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens <= MAX_NUM_TOKENS:
            raise ValueError(f"DraftProposer: num_tokens must be an int in [1, {MAX_NUM_TOKENS}], got {num_tokens!r}")
        if max_model_len > draft_model.config.max_position_embeddings:
            raise ValueError(
                f"DraftProposer: max_model_len {max_model_len} exceeds the draft model's max_position_embeddings "
                f"({draft_model.config.max_position_embeddings})"
            )
        self.block_tables = {FULL_POOL: _row_pages(num_rows, max_model_len, page_size)}
        num_pages = int(self.block_tables[FULL_POOL].max()) + 1
        num_pages = -(-num_pages // jax.device_count()) * jax.device_count()  # a mesh splits pages evenly
        self.cache = draft_model.init_cache(num_rows, paging=Paging(page_size, num_pages, max_model_len))
        if not all(has(group, PagedStorage) and group.pool == FULL_POOL for group in self.cache.groups):
            raise ValueError(
                "DraftProposer: the draft_model has sliding-window or recurrent layers, but a draft row is written "
                "over from any position; use a full-attention draft model"
            )
        self.graphdef, self.state = nnx.split(draft_model)
        self.num_rows, self.max_model_len = num_rows, max_model_len
        self.num_tokens, self.chunk_size = num_tokens, chunk_size
        self.widths, self.row_buckets = catch_up_widths(chunk_size), row_buckets(num_rows)
        self.executables: dict[tuple[str, int, int], Callable] = {}
        self.fed = [np.zeros(0, np.int32) for _ in range(num_rows)]  # tokens row r's pages hold, in order
        self.holders: list[tuple[int, int] | None] = [None] * num_rows  # the key of the sequence on each row
        self.token_seconds: float | None = None  # a fed token's time (warmup); None: calls not predicted
        self.drafting_seconds: float | None = None  # one row's drafting call at the narrowest width (warmup)
        self.calibration: float | None = None  # running mean of measured / predicted call times

    @property
    def num_compiled(self) -> int:
        return len(self.executables)

    def propose(self, seqs: Sequence[SequenceState], limits: Sequence[int]) -> list[list[int]]:
        limits, drafting, tokens = self._drafting(seqs, limits)
        if not drafting:
            return [[] for _ in seqs]
        rows = [seq.row for seq, _ in drafting]
        if len(set(rows)) < len(rows):
            raise ValueError(f"DraftProposer.propose: seqs share rows {sorted(rows)}; each row holds one sequence")
        pieces = self._pieces(rows, tokens)
        start = time.perf_counter()
        drafts = self._drafted(rows, pieces, [limit for _, limit in drafting])
        if self.token_seconds is not None:
            ratio = (time.perf_counter() - start) / self._predicted(self._calls(pieces))
            self.calibration = running_mean(self.calibration, ratio)
        for (seq, limit), held, found in zip(drafting, tokens, drafts):
            self.fed[seq.row] = np.concatenate([held, found[: limit - 1]])
            self.holders[seq.row] = seq.key
        found = iter(drafts)
        return [next(found)[:limit].tolist() if limit else [] for limit in limits]

    def cost(self, seqs: Sequence[SequenceState], limits: Sequence[int]) -> float | None:
        """The predicted seconds of ``propose(seqs, limits)``, its catch-up and drafting calls (the
        module's cost model; None before ``warmup``)."""
        if self.token_seconds is None:
            return None
        _, drafting, tokens = self._drafting(seqs, limits)
        if not drafting:
            return 0.0
        pieces = self._pieces([seq.row for seq, _ in drafting], tokens)
        return (self.calibration or 1.0) * self._predicted(self._calls(pieces))

    def release(self, seq: SequenceState) -> None:
        for row, key in enumerate(self.holders):
            if key == seq.key:
                self.fed[row], self.holders[row] = np.zeros(0, np.int32), None

    def warmup(self) -> None:
        """Compile every call (per row bucket: the full-chunk feed and each catch-up width), so no
        step waits for one; time one row's full chunk and drafting call (``cost``)."""
        for rows in self.row_buckets:
            self._executable("feed", rows, self.chunk_size)
            for width in self.widths:
                self._executable("propose", rows, width)
        self.token_seconds = self._timed("feed", 1, self.chunk_size) / self.chunk_size
        self.drafting_seconds = self._timed("propose", 1, MIN_WIDTH)

    def _timed(self, kind: str, rows: int, width: int) -> float:
        """The wall time of the compiled ``kind`` call on ``rows`` padding slots (which write
        nothing), the faster of two runs."""
        inputs = self._inputs([], rows, width)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            if kind == "feed":
                self.cache = self._executable(kind, rows, width)(self.state, self.cache, *inputs)
            else:
                _, self.cache = self._executable(kind, rows, width)(
                    self.state, self.cache, *inputs, np.zeros(rows, np.int32)
                )
            jax.block_until_ready(self.cache)
            times.append(time.perf_counter() - start)
        return min(times)

    def _predicted(self, calls: list[tuple[str, int, int]]) -> float:
        """The uncalibrated time of ``calls`` (``(kind, rows, width)``): linear in the slots each runs."""
        seconds = 0.0
        for kind, rows, width in calls:
            slots = rows * width if kind == "feed" else rows * (width + self.num_tokens - 1)
            seconds += self.token_seconds * slots + (self.drafting_seconds if kind == "propose" else 0.0)
        return seconds

    def _drafting(self, seqs: Sequence[SequenceState], limits: Sequence[int]) -> tuple[list, list, list]:
        """``limits`` checked and cut (``_limit``), the ``(seq, limit)`` pairs with a positive limit,
        and those sequences' tokens."""
        limits = [self._limit(seq, limit) for seq, limit in zip(seqs, limits, strict=True)]
        drafting = [(seq, limit) for seq, limit in zip(seqs, limits) if limit]
        return limits, drafting, [np.asarray(seq.tokens, np.int32) for seq, _ in drafting]

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

    def _pieces(self, rows: list[int], tokens: list[np.ndarray]) -> list[list[tuple[int, np.ndarray]]]:
        """Each proposing row's catch-up ``(start, tokens)`` pieces: ``tokens[i]`` (its sequence's)
        from the longest prefix the row holds (less the last token, whose logits give the first
        draft), full chunks first, then the last piece."""
        return [
            catch_up_pieces(held, min(common_prefix(self.fed[row], held), len(held) - 1), self.chunk_size)
            for row, held in zip(rows, tokens)
        ]

    def _row_bucket(self, count: int) -> int:
        return next(bucket for bucket in self.row_buckets if bucket >= count)

    def _calls(self, pieces: list[list[tuple[int, np.ndarray]]]) -> list[tuple[str, int, int]]:
        """The compiled calls ``(kind, rows, width)`` that feed ``pieces`` (``_pieces``) and draft."""
        feeds = [
            ("feed", self._row_bucket(sum(j < len(found) - 1 for found in pieces)), self.chunk_size)
            for j in range(max(len(found) for found in pieces) - 1)
        ]
        width = next(w for w in self.widths if w >= max(len(found[-1][1]) for found in pieces))
        return [*feeds, ("propose", self._row_bucket(len(pieces)), width)]

    def _drafted(self, rows: list[int], pieces: list[list[tuple[int, np.ndarray]]], limits: list[int]) -> np.ndarray:
        """Drafts ``[n, k]`` of the n proposing ``rows`` (row i's first ``limits[i]`` are its): each
        row fed its catch-up ``pieces[i]`` (``_pieces``), full chunks in calls of their own, then the
        last pieces and the drafts in one call (``_calls``)."""
        *feeds, (_, size, width) = self._calls(pieces)
        for j, (_, chunk_rows, _) in enumerate(feeds):
            chunks = [(row, found[j]) for row, found in zip(rows, pieces) if j < len(found) - 1]
            inputs = self._inputs(chunks, chunk_rows, self.chunk_size)
            self.cache = self._executable("feed", chunk_rows, self.chunk_size)(self.state, self.cache, *inputs)
        last = [(row, found[-1]) for row, found in zip(rows, pieces)]
        num_drafts = np.zeros(size, np.int32)
        num_drafts[: len(rows)] = limits
        drafts, self.cache = self._executable("propose", size, width)(
            self.state, self.cache, *self._inputs(last, size, width), num_drafts
        )
        return np.asarray(jax.device_get(drafts))[: len(rows)]

    def _inputs(self, pieces: list[tuple[int, tuple[int, np.ndarray]]], size: int, width: int) -> tuple:
        """The packed call's ``tokens`` and ``positions`` ``[size * width]`` (slot i: ``pieces[i]``,
        ``(row, (start, tokens))``, at positions ``start ..``, right-padded with position -1; slots
        past the pieces all padding), each slot's row ``[size]`` and the block tables."""
        tokens, positions = np.zeros((size, width), np.int32), np.full((size, width), -1, np.int32)
        rows = np.zeros(size, np.int32)
        for slot, (row, (start, piece)) in enumerate(pieces):
            tokens[slot, : len(piece)], rows[slot] = piece, row
            positions[slot, : len(piece)] = np.arange(start, start + len(piece))
        return tokens.reshape(-1), positions.reshape(-1), rows, self.block_tables

    def _executable(self, kind: str, rows: int, width: int) -> Callable:
        """The compiled ``kind`` call ('feed' or 'propose') for ``rows`` slots of catch-ups ``width`` tokens wide."""
        if (kind, rows, width) not in self.executables:
            flat, slots = np.zeros(rows * width, np.int32), np.zeros(rows, np.int32)
            args = (self.graphdef, self.state, self.cache, flat, flat, slots, self.block_tables)
            lowered = _fed.lower(*args) if kind == "feed" else _drafts.lower(*args, slots, self.num_tokens)
            self.executables[kind, rows, width] = lowered.compile()
        return self.executables[kind, rows, width]


def _row_pages(num_rows: int, max_model_len: int, page_size: int) -> np.ndarray:
    """The fixed block table ``[num_rows, C]``: row r's logical page j is pool page
    ``1 + r * n + j`` (n pages hold ``max_model_len`` positions), the null page past them."""
    pages = -(-max_model_len // page_size)
    table = np.full((num_rows, table_width(max_model_len, page_size)), NULL_PAGE, np.int32)
    table[:, :pages] = 1 + np.arange(num_rows * pages, dtype=np.int32).reshape(num_rows, pages)
    return table


def _feed(model, cache, tokens: jax.Array, positions: jax.Array, rows: jax.Array, block_tables: dict):
    """Slot i's tokens ``tokens[i * W : (i + 1) * W]`` (``[S * W]`` packed, right-padded with
    ``positions`` -1) written into the pages of row ``rows[i]`` ``[S]``, each slot's block reading
    its row's pages: the logits ``[S, V]`` at each slot's last token, and the cache."""
    slots = rows.shape[0]
    width = tokens.shape[0] // slots
    packed = PackedBatch(
        jnp.repeat(rows, width), block_tables, decode_tokens=slots * width, tokens_per_row=width, decode_width=width
    )
    last = jnp.arange(slots) * width + jnp.maximum(jnp.sum(positions.reshape(slots, width) >= 0, axis=1) - 1, 0)
    logits, cache = model(tokens[None], positions[None], cache, logits_index=last[None], packed=packed)
    return logits[0], cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _fed(graphdef, state, cache, tokens: jax.Array, positions: jax.Array, rows: jax.Array, block_tables: dict):
    """``_feed``'s cache: a catch-up chunk that draws nothing."""
    return _feed(nnx.merge(graphdef, state), cache, tokens, positions, rows, block_tables)[1]


@functools.partial(jax.jit, static_argnames=("graphdef", "num_tokens"), donate_argnames=("cache",))
def _drafts(
    graphdef, state, cache, tokens: jax.Array, positions: jax.Array, rows: jax.Array, block_tables: dict,
    num_drafts: jax.Array, num_tokens: int,
):  # fmt: skip
    """``_feed``, then ``num_tokens`` (k) greedy drafts per slot ``[S, k]``: draft j + 1 is drawn
    after draft j is fed, and slot i stores its first ``num_drafts[i] - 1`` drafts only (a slot
    with none stores nothing; its later drafts are drawn from padding, unused)."""
    model = nnx.merge(graphdef, state)
    logits, cache = _feed(model, cache, tokens, positions, rows, block_tables)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    next_position = jnp.max(positions.reshape(rows.shape[0], -1), axis=1) + 1  # the first draft's
    stored_before = next_position + num_drafts - 1
    packed = PackedBatch(rows, block_tables, decode_tokens=rows.shape[0], tokens_per_row=1)

    def step(carry, _):
        token, position, cache = carry
        stored = jnp.where(position < stored_before, position, -1)
        logits, cache = model(token[None], stored[None], cache, packed=packed)
        new = jnp.argmax(logits[0], axis=-1).astype(jnp.int32)
        return (new, position + 1, cache), new

    (_, _, cache), rest = jax.lax.scan(step, (first, next_position, cache), length=num_tokens - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1), cache
