"""Scheduling: which tokens of which sequences the next step computes (policy only: the pages
are the KV manager's, ``jaxkv.serving.kv_manager``).

vLLM's rule: every running sequence's computed tokens catch up with its known tokens (the
prompt, then each drawn token). Running sequences go first, oldest first: a decode brings
one token (every running row has a decode slot in each step), a prompt brings a chunk of
what the step's prefill budget leaves (chunked prefill; a chunk costs whole blocks of
``QUERY_BLOCK`` tokens, the unit paged attention reads); then waiting sequences are admitted
while rows, budget and pages last. A sequence that needs a page when the pool is full
preempts the newest running sequence: the KV manager swaps its pages to the host tier when
that beats recomputing them (``KVCacheManager.swap_out``, a documented cost rule), and it
resumes from them; else they are freed and it is computed again later, so nothing is
dropped (with prefix caching the pages it filled stay cached and usually make its
recomputation a cache hit). Under a page budget (``max_pages_per_request``) the KV manager's
``room`` caps each chunk, and a sequence waiting for a compaction skips the step.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from jaxkv.layers.paged import QUERY_BLOCK
from jaxkv.serving.kv_manager import KVCacheManager
from jaxkv.serving.requests import SequenceState, Status


@dataclasses.dataclass(frozen=True)
class Chunk:
    """``count`` tokens of ``seq`` from position ``start`` on, computed this step, followed by
    ``draft`` tokens (a decode's drafts: computed and verified by the step, kept if accepted)."""

    seq: SequenceState
    start: int
    count: int
    draft: tuple[int, ...] = ()

    @property
    def draws_next(self) -> bool:
        """Does this chunk compute the sequence's last known token (so a token is drawn)?"""
        return self.start + self.count == self.seq.num_tokens


def chunk_length(num_missing: int, budget: int) -> int:
    """Tokens a sequence missing ``num_missing`` computes next: its one missing token (a decode:
    no budget), else as many as ``budget`` holds."""
    return num_missing if num_missing <= 1 else min(num_missing, budget)


def chunk_cost(count: int) -> int:
    """Prefill budget a chunk takes: none for a decode, else whole query blocks."""
    return 0 if count == 1 else -(-count // QUERY_BLOCK) * QUERY_BLOCK


@dataclasses.dataclass
class SchedulerStats:
    """The scheduler's counters since start (the prefix cache's are the KV manager's)."""

    preemptions: int = 0
    swaps: int = 0  # preemptions whose pages went to the host tier
    recomputes: int = 0  # preemptions whose pages were freed


class Scheduler:
    """Rows and the order of work; the engine runs what ``schedule`` returns (in a step plan,
    ``jaxkv.serving.plan``) and reports back with ``computed``. Pages come from ``kv``."""

    def __init__(self, kv: KVCacheManager, max_rows: int, token_budget: int):
        self.kv = kv
        self.token_budget = token_budget
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self.running: list[SequenceState] = []
        self.free_rows = list(range(max_rows))
        self.stats = SchedulerStats()
        self._changed_rows: set[int] = set()  # rows that changed hands since the last take_changed_rows

    # --- the step's work ------------------------------------------------------------------
    def schedule(self) -> list[Chunk]:
        """This step's chunks, running sequences first, then admissions; prefill chunks within
        ``token_budget`` tokens (counted in whole query blocks)."""
        budget, chunks = self.token_budget, []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted for an older sequence this step
                continue
            count = self.kv.room(seq, chunk_length(seq.num_tokens - seq.num_computed, budget))
            if count and self._reserve_or_preempt(seq, count):
                chunks.append(Chunk(seq, seq.num_computed, count))
                budget -= chunk_cost(count)
        while self.waiting and self.free_rows and budget:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            if chunk.count:  # none: resumed at its page budget, it computes once it has compacted
                chunks.append(chunk)
                budget -= chunk_cost(chunk.count)
        return chunks

    def _reserve_or_preempt(self, seq: SequenceState, count: int) -> bool:
        """Pages for ``count`` more tokens of a running sequence, preempting the newest running
        sequences until they fit; False if ``seq`` itself had to be preempted."""
        while self.kv.allocate(seq, count) is None:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _admit(self, seq: SequenceState, budget: int) -> Chunk | None:
        """Start (or resume) a waiting sequence from its longest cached prefix (or, swapped out,
        from its own pages) with a row and the pages of its first chunk (none for a sequence
        resumed at its page budget: ``KVCacheManager.room``). None (and nothing changed) when its
        pages do not fit. A swap-in is not a prefix-cache hit: it counts in neither the
        hit rate (``KVCacheManager.prefix_stats``) nor the sequence's cached tokens. Under a page
        budget it waits while the pool does not hold every running sequence's budget and its own
        (``KVCacheManager.holds_budgets``)."""
        if not self.kv.holds_budgets(self.running, seq):
            return None
        hit = self.kv.lookup(seq)
        count = self.kv.room(seq, chunk_length(seq.num_tokens - hit.num_tokens, budget), hit)
        allocation = self.kv.allocate(seq, count, hit) if count or hit.resumes else None
        if allocation is None:
            return None
        seq.num_computed = allocation.num_cached_tokens
        self._start(seq)
        if not hit.resumes:
            seq.num_cached_tokens = seq.num_computed
        return Chunk(seq, seq.num_computed, count)

    def _start(self, seq: SequenceState) -> None:
        seq.status, seq.row = Status.RUNNING, self.free_rows.pop(0)
        self.running.append(seq)
        self._changed_rows.add(seq.row)

    def take_changed_rows(self) -> set[int]:
        """The rows a sequence took or left since the last call (their block-table rows are
        written whole by the next step plan)."""
        rows, self._changed_rows = self._changed_rows, set()
        return rows

    # --- after the step -------------------------------------------------------------------
    def computed(self, chunks: list[Chunk], accepted: Sequence[int] | None = None) -> None:
        """The step ran and its tokens were appended: advance each chunk's sequence past its tokens
        and its ``accepted`` drafts (None: no drafts; at most to its tokens: a stop may cut the
        drafts); its full pages go to the prefix cache. The K/V of rejected drafts stay past the
        computed count."""
        for chunk, num_accepted in zip(chunks, [0] * len(chunks) if accepted is None else accepted, strict=True):
            seq = chunk.seq
            seq.num_computed = min(chunk.start + chunk.count + int(num_accepted), seq.num_tokens)
            self.kv.computed(seq)

    # --- leaving ----------------------------------------------------------------------------
    def _leave(self, seq: SequenceState) -> None:
        """Take ``seq``'s row (its pages are the caller's business); it keeps its tokens."""
        if seq.row is not None:
            self.free_rows.append(seq.row)
            self._changed_rows.add(seq.row)
            seq.row = None
        if seq in self.running:
            self.running.remove(seq)
        seq.num_computed = 0

    def preempt(self, seq: SequenceState) -> None:
        """Take a running sequence's pages: swapped to the host tier (it resumes from them) when
        the KV manager finds that pays and fits, else freed (it is computed again). It waits at
        the front."""
        if self.kv.swap_out(seq):
            self.stats.swaps += 1
        else:
            self.kv.free(seq)
            self.stats.recomputes += 1
        self._leave(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def finish(self, seq: SequenceState) -> None:
        """Free a sequence that has finished or was aborted, wherever it is."""
        self.kv.free(seq)
        self._leave(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    # --- n > 1: sequences that share their prompt's pages ----------------------------------------
    def fork(self, parent: SequenceState, child: SequenceState) -> dict[str, list[tuple[int, int]]] | None:
        """Start ``child`` on ``parent``'s computed prompt (``KVCacheManager.fork``); it recomputes
        the prompt's last token to draw its own first one. Returns the page copies per pool, or
        None (nothing changed) when there is no row or page for it."""
        if not self.free_rows:
            return None
        allocation = self.kv.fork(parent, child)
        if allocation is None:
            return None
        child.num_computed = len(child.prompt) - 1
        self._start(child)
        return allocation.copies
