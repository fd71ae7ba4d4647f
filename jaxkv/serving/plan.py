"""The step plan: one step of the engine as plain data, handed by the scheduler (with the KV
manager) to the model runner (vLLM's ``SchedulerOutput``).

A plan says what each sample slot computes (``chunks``: a sequence's tokens on its row, with the
drafts it brings to verify), how the block tables change (``tables``: per pool, each changed row
from its first changed column on; ``shifts``: the compacted rows' shifts), which pages move
between the device pools and the host tier or are compacted (``moves``) and which pages a fork
copies (``copies``). ``plan_step`` assembles it from what the scheduler and the KV manager
decided since the last plan, so a plan is built and checked without a model.

The model runner keeps its block tables from step to step (``BlockTables``) and applies each
plan's changes row by row instead of rebuilding them: a row that changed hands (a sequence took
it or left it) is written whole; a row whose sequence kept it is written from its first changed
page on (pages appended, pages a sliding window left, a compaction); every other row stays as it
is. ``block_tables`` and ``row_shifts`` rebuild them whole from the KV manager, the tests' oracle.

A step's plan is made before it runs; the forks that follow its outputs make a plan of their own
(their copies, no chunks), applied at once (a child swapped out before its first step must find
its copied page).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from jaxkv.layers.paged import FULL_POOL, NULL_PAGE
from jaxkv.serving.kv_manager import KVCacheManager
from jaxkv.serving.requests import SequenceState
from jaxkv.serving.scheduler import Chunk, Scheduler
from jaxkv.serving.tier_manager import PageMoves


@dataclasses.dataclass(frozen=True)
class RowUpdate:
    """One block-table row's change: row ``row`` holds ``pages`` (pool page ids) from column
    ``start`` on, then the null page to its end (``start`` 0 and no pages: the row is empty)."""

    row: int
    start: int
    pages: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step of the engine (the module docstring). Every field is host data (Python ints and
    tuples; the host pages the moves fill); the model runner turns it into the step's device
    inputs (``StepInputs``, NumPy arrays sent with the call) and the device's page copies.

    ``chunks``: ``tuple[Chunk, ...]`` ``[S]``, chunk ``i`` computed in sample slot ``i``: its
    sequence's ``count`` tokens from position ``start`` on (on the sequence's row), then its
    ``draft`` tokens to verify; empty: the plan runs no step (a fork's, or nothing to schedule).
    ``tables``: ``dict[str, tuple[RowUpdate, ...]]``, per pool name the block-table rows that
    changed since the last plan; the other rows stay as they were.
    ``shifts``: ``tuple[tuple[int, int], ...]``, ``(row, shift)`` for each row whose full-pool
    row was written from column 0 (only then can its shift change: an admission, a compaction, a
    row left: 0) under a page budget (``PackedBatch.shifts``); empty without one.
    ``moves``: ``PageMoves``, the copies between the device pools and the host tier and the
    compactions, made before the step runs (reads, compactions, writes), and the pages read for
    the disk tier (``moves.persist``, saved by the engine once read).
    ``copies``: ``dict[str, list[tuple[int, int]]]``, per pool name a fork's ``(source,
    destination)`` page copies, made after the moves.
    """

    chunks: tuple[Chunk, ...]
    tables: dict[str, tuple[RowUpdate, ...]]
    shifts: tuple[tuple[int, int], ...]
    moves: PageMoves
    copies: dict[str, list[tuple[int, int]]]


class BlockTables:
    """The model runner's block tables, kept from step to step and changed only by ``apply``:
    ``tables`` per pool name ``[R, W]`` int32 (row r's logical page j is pool page
    ``tables[pool][r, j]``, the null page where it holds nothing; ``W``:
    ``KVCacheManager.table_widths``) and ``shifts`` (``PackedBatch.shifts``: ``{'full': [R]}``
    int32 under a page budget, ``shifted``; else empty). Host arrays a step reads as they are
    (JAX may alias NumPy arguments on a CPU): apply a plan only once the step before has finished."""

    def __init__(self, num_rows: int, widths: dict[str, int], shifted: bool):
        self.tables = {name: np.full((num_rows, width), NULL_PAGE, np.int32) for name, width in widths.items()}
        self.shifts = {FULL_POOL: np.zeros(num_rows, np.int32)} if shifted else {}

    def apply(self, plan: StepPlan) -> None:
        """Write ``plan``'s changed rows and shifts."""
        for name, updates in plan.tables.items():
            table = self.tables[name]
            for update in updates:
                end = update.start + len(update.pages)
                table[update.row, update.start : end] = update.pages
                table[update.row, end:] = NULL_PAGE
        for row, shift in plan.shifts:
            self.shifts[FULL_POOL][row] = shift


def plan_step(
    scheduler: Scheduler, chunks: Sequence[Chunk] = (), copies: dict[str, list[tuple[int, int]]] | None = None
) -> StepPlan:
    """The plan of a step that computes ``chunks`` (none: a plan of changes only) and makes a
    fork's ``copies``: the rows and the page moves the scheduler and its KV manager decided since
    the last plan (``Scheduler.take_changed_rows``, ``KVCacheManager.take_edits``,
    ``KVCacheManager.take_moves``)."""
    kv = scheduler.kv
    changed, edits = scheduler.take_changed_rows(), kv.take_edits()
    tables = {
        name: _row_updates(kv, name, scheduler.running, changed, pool_edits) for name, pool_edits in edits.items()
    }
    shifts = _shift_updates(kv, scheduler.running, tables.get(FULL_POOL, ()))
    return StepPlan(tuple(chunks), tables, shifts, kv.take_moves(), copies or {})


def _row_updates(
    kv: KVCacheManager, pool: str, running: Sequence[SequenceState], changed: set[int], edits: dict[Hashable, int]
) -> tuple[RowUpdate, ...]:
    """The block-table changes of the pool named ``pool``: each row in ``changed`` whole (its
    running sequence's pages, or none), each other running sequence's row from the first page
    ``edits`` gives its key on (unlisted: unchanged)."""
    updates = []
    for seq in running:
        first = 0 if seq.row in changed else edits.get(seq.key)
        if first is not None:
            updates.append(RowUpdate(seq.row, first, tuple(kv.pages(pool, seq)[first:])))
    left = changed - {seq.row for seq in running}
    return (*updates, *(RowUpdate(row, 0, ()) for row in sorted(left)))


def _shift_updates(
    kv: KVCacheManager, running: Sequence[SequenceState], full: Sequence[RowUpdate]
) -> tuple[tuple[int, int], ...]:
    """``(row, shift)`` of the ``full``-pool rows written from column 0, under a page budget."""
    if kv.compaction.budget is None:
        return ()
    holders = {seq.row: seq for seq in running}
    return tuple(
        (update.row, kv.shift(holders[update.row]) if update.row in holders else 0)
        for update in full
        if update.start == 0
    )


def block_tables(
    kv: KVCacheManager, running: Sequence[SequenceState], num_rows: int, max_model_len: int
) -> dict[str, np.ndarray]:
    """Per pool name ``[R, W]`` int32: each running sequence's pages in its row, the null page
    elsewhere, rebuilt whole: the oracle of ``BlockTables``, which the step plans change row by row."""
    tables = {}
    for name, width in kv.table_widths(max_model_len).items():
        table = np.full((num_rows, width), NULL_PAGE, np.int32)
        for seq in running:
            pages = kv.pages(name, seq)
            table[seq.row, : len(pages)] = pages
        tables[name] = table
    return tables


def row_shifts(kv: KVCacheManager, running: Sequence[SequenceState], num_rows: int) -> dict[str, np.ndarray]:
    """``PackedBatch.shifts``: ``[R]`` each running row's shift in the full pool under a page budget
    (0 for the other rows); empty without one. Rebuilt whole: the oracle of ``BlockTables.shifts``."""
    if kv.compaction.budget is None:
        return {}
    shifts = np.zeros(num_rows, np.int32)
    for seq in running:
        shifts[seq.row] = kv.shift(seq)
    return {FULL_POOL: shifts}
