"""Model running: a step's chunks packed into the compiled step's inputs (nano-vllm's
``ModelRunner.prepare_*``), one executable per step shape, and the step run on the device.

A step's tokens: ``D`` decode slots of ``W`` tokens first (``W`` = 1; a step that verifies
drafts: ``1 + k``, a row's token then its drafts), then ``prefill_size`` slots of prefill
chunks, each starting a block of ``QUERY_BLOCK`` tokens (the unit paged attention reads), the
rest padding. Each scheduled chunk also has a sample slot (chunk ``i``: slot ``i`` of ``D``),
where its row's next tokens are drawn. ``prefill_size`` is the smallest prefill bucket that
holds the step's chunks. ``D`` is the engine's row count when the step prefills; a
decode-only step takes the smallest decode bucket that holds its rows, so a few running rows
do not pay for the GEMM rows, attention reads and LM head of all (a verifying step's buckets
go down to one slot: each is ``W`` tokens wide). ``warmup`` compiles every shape, and no step
compiles after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv.batch import QUERY_BLOCK, PackedBatch
from jaxkv.decoding.sampling import GREEDY, RowSampling
from jaxkv.layers.paged import NULL_PAGE
from jaxkv.serving.compaction import COMPACTION_ROWS, Compaction, PageBudget, compact_pages, compaction_inputs
from jaxkv.serving.host_tier import HostPage
from jaxkv.serving.kv_manager import PageMoves
from jaxkv.serving.plan import BlockTables, StepPlan
from jaxkv.serving.scheduler import Chunk, chunk_cost
from jaxkv.serving.step import (
    StepInputs,
    StepOutputs,
    compiled_step,
    copy_pages,
    page_formats,
    read_pages,
    write_pages,
)

# The fewest decode slots a decode-only step is given (fewer saves too little to compile for).
MIN_DECODE_SLOTS = 8


def prefill_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Sizes of a step's prefill section: 0, then powers of two from ``QUERY_BLOCK`` up to the budget."""
    sizes, size = [0], QUERY_BLOCK
    while size < max_num_batched_tokens:
        sizes.append(size)
        size *= 2
    return (*sizes, max_num_batched_tokens)


def decode_buckets(num_rows: int) -> tuple[int, ...]:
    """Decode slots of a decode-only step: ``num_rows`` halved while it stays even and at least
    ``MIN_DECODE_SLOTS``, smallest first (``num_rows`` itself always)."""
    sizes = [num_rows]
    while sizes[-1] % 2 == 0 and sizes[-1] // 2 >= MIN_DECODE_SLOTS:
        sizes.append(sizes[-1] // 2)
    return tuple(reversed(sizes))


def copy_bucket(num_pages: int) -> int:
    """Pages a batch of ``num_pages`` host-tier copies is padded to: the next power of two (one
    compiled read and one compiled write per bucket)."""
    return 1 << max(num_pages - 1, 0).bit_length()


def decode_buckets_wide(num_rows: int) -> tuple[int, ...]:
    """Decode slots of a decode-only step that verifies drafts: ``num_rows`` halved while it
    stays even, down to one slot, smallest first."""
    sizes = [num_rows]
    while sizes[-1] % 2 == 0:
        sizes.append(sizes[-1] // 2)
    return tuple(reversed(sizes))


def step_shapes(num_rows: int, max_num_batched_tokens: int, width: int = 1) -> tuple[tuple[int, int, int], ...]:
    """Every compiled step shape, ``(decode slots, prefill size, decode width)``: all rows with
    each prefill bucket, and each smaller decode bucket without prefill; with ``width`` > 1 (a
    speculating engine's ``1 + k``) the same again with decode slots that wide."""
    prefills = prefill_buckets(max_num_batched_tokens)
    shapes = [*((num_rows, size, 1) for size in prefills), *((slots, 0, 1) for slots in decode_buckets(num_rows)[:-1])]
    if width > 1:
        shapes += [(num_rows, size, width) for size in prefills]
        shapes += [(slots, 0, width) for slots in decode_buckets_wide(num_rows)[:-1]]
    return tuple(shapes)


class ModelRunner:
    """The model's parameters and paged cache on the device, the block tables (``tables``, kept
    from step to step and changed by each step plan's rows: ``apply``), and the compiled steps
    over them. ``num_rows``: the engine's rows (block-table rows, the most decode slots);
    ``table_widths``: block-table columns per pool name (``KVCacheManager.table_widths``);
    ``num_top``: top log-probabilities computed per sample slot (at least 1); ``width``: ``1 + k``
    for an engine that verifies ``k`` drafts per row (1: none); ``budget``: the page budget whose
    compactions ``move_pages`` makes (None: none); ``dense_prompts``: prompt tokens read every
    page of the retrieving pool (``PackedBatch.dense_queries``; ``RetrievalSpec.prefill='dense'``)."""

    def __init__(
        self, model, cache, num_rows: int, table_widths: dict[str, int], max_num_batched_tokens: int, num_top: int,
        width: int = 1, budget: PageBudget | None = None, dense_prompts: bool = False,
    ):  # fmt: skip
        self.graphdef, self.state = nnx.split(model)
        self.cache = cache
        self.num_rows = num_rows
        self.tables = BlockTables(num_rows, table_widths, shifted=budget is not None)
        self.width = width
        self.shapes = step_shapes(num_rows, max_num_batched_tokens, width)
        self.prefills = prefill_buckets(max_num_batched_tokens)
        self.decodes = {width: decode_buckets_wide(num_rows), 1: decode_buckets(num_rows)}  # width 1: plain
        self.num_top = num_top
        self.executables: dict[tuple[int, int, int], Callable] = {}
        self.num_steps = 0
        self.page_formats = page_formats(cache)
        self.budget = budget
        self.dense_prompts = dense_prompts

    def apply(self, plan: StepPlan) -> None:
        """Make a step plan's page moves, then its fork copies, and write its changed block-table
        rows (the step it plans, if any, is ``run`` next)."""
        if plan.moves:
            self.move_pages(plan.moves)
        self.copy_pages(plan.copies)
        self.tables.apply(plan)

    def copy_pages(self, copies: dict[str, list[tuple[int, int]]]) -> None:
        """Copy forks' pages: ``(source, destination)`` pairs per pool name (none: nothing runs)."""
        if any(copies.values()):
            self.cache = copy_pages(self.cache, {name: np.asarray(pairs, np.int32) for name, pairs in copies.items()})

    def run(self, chunks: Sequence[Chunk]) -> StepOutputs:
        """Run one step over ``chunks`` (a plan's, applied: ``apply``; with drafts: a verifying
        step) on the block tables; returns the outputs on the host, chunk ``i``'s in sample slot ``i``."""
        with jax.profiler.TraceAnnotation("runner.prepare"):
            inputs = self.prepare(chunks)
        with jax.profiler.TraceAnnotation("runner.dispatch"):
            outputs, self.cache = self._executable(inputs)(self.state, self.cache, inputs)
        self.num_steps += 1
        with jax.profiler.TraceAnnotation("runner.wait"):
            return jax.device_get(outputs)

    def move_pages(self, moves: PageMoves) -> None:
        """Make a step's copies between the device pools and the host tier: every read first (a
        page read may be written by a later copy or by the step), then the compactions (a page a
        compaction reads may be written by a promotion), then every write. Each batch of copies
        is padded to ``copy_bucket`` pages of every pool."""
        if any(moves.out.values()):
            self._read(moves.out)
        if moves.compactions:
            self._compact(moves.compactions)
        if any(moves.into.values()):
            self._write(moves.into)

    def _compact(self, compactions: list[Compaction], rows: int | None = None) -> None:
        """Make ``compactions`` in one call of the compiled compaction (padded to ``rows``, or to
        the smallest shape that holds them), dispatched without waiting: the next step follows it."""
        inputs = compaction_inputs(compactions, self.budget, rows)
        self.cache = compact_pages(self.cache, *inputs, budget=self.budget)

    def _read(self, out: dict[str, list[tuple[int, HostPage]]]) -> None:
        """Fill each host page with its device page: one array per leaf of its pool's paged groups."""
        pages = self._bucketed({name: [page for page, _ in pairs] for name, pairs in out.items()})
        found = jax.device_get(read_pages(self.cache, pages))  # per paged group, per leaf [K, L, ...]
        for name, pairs in out.items():
            groups = [group for (pool, _), group in zip(self.page_formats, found) if pool == name]
            for k, (_, host_page) in enumerate(pairs):
                host_page.arrays = [np.array(leaf[k]) for group in groups for leaf in group]

    def _write(self, into: dict[str, list[tuple[HostPage, int]]]) -> None:
        """Write each host page into its device page."""
        pages = self._bucketed({name: [page for _, page in pairs] for name, pairs in into.items()})
        size = len(next(iter(pages.values())))
        self.cache = write_pages(self.cache, pages, self._stacked(into, size))

    def warmup_copies(self, max_pages: int) -> None:
        """Run the host-tier copies once per ``copy_bucket`` up to ``max_pages`` pages, on the null
        page only (its contents are padding), so that no step waits for their compile."""
        size = 0
        while size < max_pages:
            size = copy_bucket(size + 1)
            pages = {name: np.full(size, NULL_PAGE, np.int32) for name, _ in self.page_formats}
            jax.block_until_ready(read_pages(self.cache, pages))
            self.cache = write_pages(self.cache, pages, self._stacked({}, size))

    def _bucketed(self, pages: dict[str, list[int]]) -> dict[str, np.ndarray]:
        """``pages`` per pool name, every pool padded with the null page to one ``copy_bucket``."""
        size = copy_bucket(max(len(found) for found in pages.values()))
        names = {pool for pool, _ in self.page_formats}
        return {
            name: np.array([*pages.get(name, []), *[NULL_PAGE] * (size - len(pages.get(name, [])))], np.int32)
            for name in names
        }

    def _stacked(self, into: dict[str, list[tuple[HostPage, int]]], size: int) -> list[list[np.ndarray]]:
        """The host pages' arrays stacked per paged group and leaf ``[size, L, ...]`` (zeros as padding)."""
        data, position = [], {}
        for pool, formats in self.page_formats:
            start = position.get(pool, 0)  # where this group's leaves start in a page's arrays
            position[pool] = start + len(formats)
            group = []
            for offset, shape in enumerate(formats):
                stacked = np.zeros((size, *shape.shape), shape.dtype)
                for k, (host_page, _) in enumerate(into.get(pool, [])):
                    stacked[k] = host_page.arrays[start + offset]
                group.append(stacked)
            data.append(group)
        return data

    def warmup(self) -> None:
        """Compile the step for every shape (and the compaction, under a page budget: run on
        padding rows, which write the null page only), so no request waits for a compile."""
        for slots, prefill, width in self.shapes:
            self._executable(self._packed([], slots, prefill, width))
        for rows in COMPACTION_ROWS if self.budget is not None else ():
            self._compact([], rows)

    def prepare(self, chunks: Sequence[Chunk]) -> StepInputs:
        """The step's inputs in the smallest shape that holds ``chunks`` (decode slots ``width`` wide
        when a chunk brings drafts)."""
        width = self.width if any(chunk.draft for chunk in chunks) else 1
        return self._packed(chunks, *self.step_shape(chunks, width))

    def step_shape(self, chunks: Sequence[Chunk], width: int) -> tuple[int, int, int]:
        """``(decode slots, prefill size, width)``: the shape that runs ``chunks`` with decode slots
        ``width`` tokens wide."""
        prefill = sum(chunk_cost(chunk.count) for chunk in chunks)
        return (*self.prepare_shape(len(chunks), prefill, width), width)

    def prepare_shape(self, num_chunks: int, prefill: int, width: int = 1) -> tuple[int, int]:
        """``(decode slots, prefill size)`` of a step of ``num_chunks`` chunks taking ``prefill``
        prefill slots: the smallest prefill bucket that holds them; all rows' decode slots when
        it prefills, else the smallest decode bucket (of slots ``width`` wide) that holds the chunks."""
        prefill_size = next(size for size in self.prefills if size >= prefill)
        return (
            self.num_rows if prefill_size else next(size for size in self.decodes[width] if size >= num_chunks)
        ), prefill_size

    def _score_weights(self, positions: np.ndarray, prompt_lengths: np.ndarray) -> np.ndarray | None:
        """``PackedBatch.score_weights`` of packed tokens at ``positions`` of sequences with
        ``prompt_lengths`` (both ``[N]``): the page budget's (None: the layer's default)."""
        if self.budget is None:
            return None
        return self.budget.score_weights(positions, prompt_lengths)

    def _executable(self, inputs: StepInputs) -> Callable:
        """The compiled step for this shape (compiled on first use, or by ``warmup``)."""
        slots, width = inputs.sample_index.shape
        shape = (slots, inputs.tokens.shape[0] - slots * width, width)
        if shape not in self.executables:
            lowered = compiled_step.lower(self.graphdef, self.state, self.cache, inputs, self.num_top)
            self.executables[shape] = lowered.compile()
        return self.executables[shape]

    def _packed(self, chunks: Sequence[Chunk], slots: int, prefill_size: int, width: int) -> StepInputs:
        """``slots`` decode slots of ``width`` tokens, then ``prefill_size`` slots of prefill chunks,
        each starting a query block; chunk ``i`` draws in sample slot ``i``, with its sequence's
        sampling, at its last token and its drafts; the block tables and shifts as they are."""
        size = slots * width + prefill_size
        tokens, positions, token_rows = np.zeros(size, np.int32), np.full(size, -1, np.int32), np.zeros(size, np.int32)
        prompt_lengths = np.zeros(size, np.int32)
        sample_index, num_logprobs = np.zeros((slots, width), np.int32), np.zeros(slots, np.int32)
        drafts, num_drafts = np.zeros((slots, width - 1), np.int32), np.zeros(slots, np.int32)
        seeds, numbers, counters = np.zeros(slots, np.uint32), np.zeros(slots, np.int32), np.zeros(slots, np.int32)
        slot_sampling = [GREEDY] * slots
        decode_slot, prefill_slot = 0, slots * width
        for slot, chunk in enumerate(chunks):
            seq, length = chunk.seq, chunk.count + len(chunk.draft)
            if chunk.count == 1:
                start, decode_slot = decode_slot, decode_slot + width
                token_rows[start : start + width] = seq.row  # padding of the decode block: its row too
            else:
                start, prefill_slot = prefill_slot, prefill_slot + chunk_cost(chunk.count)
                token_rows[start:prefill_slot] = seq.row  # padding of the chunk's last block: its row too
            end = start + length
            tokens[start:end] = [*seq.tokens[chunk.start : chunk.start + chunk.count], *chunk.draft]
            positions[start:end] = np.arange(chunk.start, chunk.start + length)
            prompt_lengths[start:end] = len(seq.prompt)
            sample_index[slot] = end - 1 - len(chunk.draft) + np.minimum(np.arange(width), len(chunk.draft))
            drafts[slot, : len(chunk.draft)], num_drafts[slot] = chunk.draft, len(chunk.draft)
            num_logprobs[slot] = seq.options.logprobs
            seeds[slot], numbers[slot], counters[slot] = seq.options.seed, seq.index, len(seq.output)
            slot_sampling[slot] = seq.options.sampling
        # A prefill chunk fills at most what the decode slots leave: the rows' [R, T] layout's T.
        packed = PackedBatch(
            token_rows, self.tables.tables, decode_tokens=slots * width, tokens_per_row=max(width, prefill_size),
            decode_width=width, shifts=self.tables.shifts,
            score_weights=self._score_weights(positions, prompt_lengths),
            decode_pages=None if self.budget is None else self.budget.max_pages,
            dense_queries=(positions >= 0) & (positions < prompt_lengths) if self.dense_prompts else None,
        )  # fmt: skip
        return StepInputs(
            tokens=tokens, positions=positions, packed=packed, sample_index=sample_index, drafts=drafts,
            num_drafts=num_drafts, num_logprobs=num_logprobs, seeds=seeds, sample_numbers=numbers, counters=counters,
            sampling=RowSampling.stack(slot_sampling),
        )  # fmt: skip
