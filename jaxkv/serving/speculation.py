"""Speculation: draft tokens proposed for the engine's decoding rows, verified by the next step.

Each step, a running sequence that decodes (one token to compute) may bring ``k`` draft tokens
after it: the step computes the token and the drafts at positions ``L .. L + k`` in the
sequence's own pages, the target's logits there decide on the device how many drafts it keeps
(``jaxkv.serving.step.verify_rows``), and the sequence's computed count then grows by
``1 + accepted`` only: the K/V of rejected drafts stay in its pages past that count, masked by
position, and the next step overwrites them (vLLM's rule: no page is freed or copied). The
prefix cache only hashes pages of computed tokens, so it never holds a draft.

Proposers (``Proposer``) run on the host before the step: ``NgramProposer`` copies what followed
the latest earlier occurrence of the sequence's last n tokens (prompt lookup); the draft-model
proposer runs a smaller model. Drafts are proposed deterministically (the draft model drafts
greedily), so the target's sampled acceptance is the one-hot case of the speculative sampling
rule: a draft ``d`` is kept with probability ``p(d)``, and at the first rejection the token is
drawn from ``p`` with ``d`` removed; every kept token is distributed as plain sampling draws it.

When speculation pays (``Speculation.plan``, the documented rule): a sequence proposes only
when its proposer finds drafts, it has tokens left to make (``max_tokens``, the model's
length), its request did not opt out, and its pages for the drafts fit without preempting
anyone; a sequence whose last ``BACKOFF_AFTER`` proposals were all rejected stops proposing for
``2 ** j`` steps (``j`` grows with each such run, to ``MAX_BACKOFF_EXPONENT``); and a step
verifies drafts only when at least ``min_fraction`` of its decoding sequences bring drafts
(each decode slot of a verifying step is ``1 + k`` tokens wide, so a few drafts among many
plain decodes cost more than they save).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxkv.serving.kv_manager import KVCacheManager
from jaxkv.serving.requests import SequenceState
from jaxkv.serving.scheduler import Chunk

SPECULATIVE_METHODS = ("ngram", "draft")
MAX_NUM_TOKENS = 15  # drafts per step: the sequence's token and its drafts fit one query block


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """The engine's speculation (``EngineConfig.speculative``).

    ``method``: 'ngram' (prompt lookup over the sequence's own tokens) or 'draft' (a smaller
    model, ``draft_model``, with the target's vocabulary). ``num_tokens``: drafts per step
    (``k``, 1 to ``MAX_NUM_TOKENS``). ``max_ngram`` / ``min_ngram``: the n-gram lengths prompt
    lookup matches, longest first. ``min_fraction``: the least fraction of a step's decoding
    sequences that must bring drafts for the step to verify any (``Speculation.plan``).
    ``draft_model``: the draft model (a ``DecoderModel``) for 'draft'.
    """

    method: str = "ngram"
    num_tokens: int = 4
    max_ngram: int = 4
    min_ngram: int = 2
    min_fraction: float = 0.5
    draft_model: object | None = None

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"SpeculativeConfig.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        for name in ("num_tokens", "max_ngram", "min_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SpeculativeConfig.{name} must be a positive int, got {value!r}")
        if self.num_tokens > MAX_NUM_TOKENS:
            raise ValueError(f"SpeculativeConfig.num_tokens must be at most {MAX_NUM_TOKENS}, got {self.num_tokens}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"SpeculativeConfig needs min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}"
            )
        if not 0 <= self.min_fraction <= 1:
            raise ValueError(f"SpeculativeConfig.min_fraction must be in [0, 1], got {self.min_fraction}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("SpeculativeConfig: method 'draft' needs a draft_model, and only it takes one")


class Proposer(abc.ABC):
    """Drafts for decoding sequences, proposed on the host before a step."""

    @abc.abstractmethod
    def propose(self, seqs: Sequence[SequenceState], limits: Sequence[int]) -> list[list[int]]:
        """Up to ``limits[i]`` draft tokens to follow ``seqs[i]``'s tokens (each running, on its
        row, with exactly its last token not computed); an empty list: no proposal."""

    def release(self, seq: SequenceState) -> None:  # noqa: B027 - optional: proposers without per-row state
        """``seq`` finished or was aborted: forget what was kept for it (a proposer must not need
        this for correctness: a preempted sequence leaves its row without it)."""

    def warmup(self) -> None:  # noqa: B027 - optional: proposers that compile nothing
        """Compile what ``propose`` runs, so no step waits for a compile."""


@dataclasses.dataclass(frozen=True)
class NgramProposer(Proposer):
    """Prompt lookup: for n from ``max_ngram`` down to ``min_ngram``, the latest earlier
    occurrence of the sequence's last n tokens; the drafts are the tokens that followed it (at
    most up to the sequence's end: a match near the end proposes fewer)."""

    max_ngram: int
    min_ngram: int

    def propose(self, seqs: Sequence[SequenceState], limits: Sequence[int]) -> list[list[int]]:
        return [ngram_drafts(np.asarray(seq.tokens, np.int64), limit, self.max_ngram, self.min_ngram)
                for seq, limit in zip(seqs, limits, strict=True)]  # fmt: skip


def ngram_drafts(tokens: np.ndarray, limit: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``limit`` tokens that followed the latest earlier occurrence of the last n of
    ``tokens`` ``[L]`` (the longest n in ``[min_ngram, max_ngram]`` that has one); none without."""
    length = len(tokens)
    if limit < 1:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # starts 0 .. L - 1 - n
        found = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if found.size:
            start = int(found[-1]) + n
            return tokens[start : start + limit].tolist()
    return []


# A sequence whose last ``BACKOFF_AFTER`` verifications kept no draft waits ``2 ** j`` steps
# before it proposes again, ``j`` growing with each such verification up to ``MAX_BACKOFF_EXPONENT``.
BACKOFF_AFTER = 2
MAX_BACKOFF_EXPONENT = 5


@dataclasses.dataclass
class _Backoff:
    misses: int = 0  # verifications in a row that kept no draft
    resume_step: int = 0  # the first step it proposes again


@dataclasses.dataclass
class SpeculationStats:
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, kept
    steps: int = 0  # sequence-steps that verified drafts

    def as_dict(self) -> dict:
        """The counters, the acceptance rate and the mean accepted length (tokens a verifying
        sequence-step makes: 1 + accepted drafts)."""
        rate = self.accepted / self.proposed if self.proposed else 0.0
        length = 1 + self.accepted / self.steps if self.steps else 0.0
        return {**dataclasses.asdict(self), "acceptance_rate": rate, "mean_accepted_length": length}


class Speculation:
    """The engine's speculation stage: drafts for a step's decoding chunks when they pay (the
    module's rule), and what the step kept of them. ``kv`` grants the drafts' pages;
    ``max_model_len``: no draft reaches past it."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, kv: KVCacheManager, max_model_len: int):
        self.config, self.proposer, self.kv, self.max_model_len = config, proposer, kv, max_model_len
        self.stats = SpeculationStats()
        self.backoff: dict[tuple[int, int], _Backoff] = {}
        self.num_steps = 0

    def plan(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` with drafts for the decoding sequences that get them, or unchanged when too
        few would (``min_fraction`` of the decodes)."""
        self.num_steps += 1
        decodes = sum(chunk.count == 1 for chunk in chunks)
        candidates = [i for i, chunk in enumerate(chunks) if self._may_propose(chunk)]
        if not candidates or len(candidates) < self.config.min_fraction * decodes:
            return chunks
        limits = [self._limit(chunks[i].seq) for i in candidates]
        proposals = self.proposer.propose([chunks[i].seq for i in candidates], limits)
        drafts = {
            i: tuple(draft[:limit])
            for i, draft, limit in zip(candidates, proposals, limits, strict=True)
            if draft and self.kv.allocate(chunks[i].seq, 1 + len(draft[:limit])) is not None
        }  # a draft's pages are granted without preempting anyone (and kept when the step does not verify)
        if not drafts or len(drafts) < self.config.min_fraction * decodes:
            return chunks
        return [dataclasses.replace(chunk, draft=drafts[i]) if i in drafts else chunk for i, chunk in enumerate(chunks)]

    def _may_propose(self, chunk: Chunk) -> bool:
        seq = chunk.seq
        backoff = self.backoff.get(seq.key)
        return (
            chunk.count == 1 and chunk.draws_next and seq.options.speculative and self._limit(seq) > 0
            and (backoff is None or backoff.resume_step <= self.num_steps)
        )  # fmt: skip

    def _limit(self, seq: SequenceState) -> int:
        """Drafts ``seq`` may bring: ``num_tokens``, less than the tokens it may still make."""
        left = min(seq.options.max_tokens - len(seq.output), self.max_model_len - seq.num_tokens)
        return min(self.config.num_tokens, left - 1)

    def verified(self, chunk: Chunk, accepted: int) -> None:
        """The step kept ``accepted`` of ``chunk``'s drafts: count them, and back off a sequence
        whose drafts keep failing."""
        if not chunk.draft:
            return
        seq = chunk.seq
        seq.num_proposed += len(chunk.draft)
        seq.num_accepted += accepted
        seq.num_speculative_steps += 1
        self.stats.proposed += len(chunk.draft)
        self.stats.accepted += accepted
        self.stats.steps += 1
        backoff = self.backoff.setdefault(seq.key, _Backoff())
        backoff.misses = 0 if accepted else backoff.misses + 1
        if backoff.misses >= BACKOFF_AFTER:
            exponent = min(backoff.misses - BACKOFF_AFTER + 1, MAX_BACKOFF_EXPONENT)
            backoff.resume_step = self.num_steps + 2**exponent

    def release(self, seq: SequenceState) -> None:
        """``seq`` finished or was aborted: forget its backoff and the proposer's record of it."""
        self.backoff.pop(seq.key, None)
        self.proposer.release(seq)
