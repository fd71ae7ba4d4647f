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

When speculation pays (``Speculation.plan``, the documented rule): a sequence brings drafts only
when its proposer finds some, it may still make more than one token (``max_tokens``, the model's
length), its request did not opt out, and the drafts' pages fit without preempting anyone. A
step then verifies them only when that makes more tokens a second than the plain step, measured:
every compiled shape's wall time is a running mean (``observe``), and so is the number of drafts
each sequence's verifications kept (a sequence not verified yet expects the running mean over
all). Proposals cost ``P`` seconds: a proposer that predicts its calls (``Proposer.cost``: the
draft model, from its timed calls) is charged what the step's proposals would take, the catch-up
it feeds first included whole (a new prompt, the tokens since a row last proposed: paid in this
step, so charged to it; spread over later steps, a catch-up was paid where the step's gain came
from the rows already caught up, and lost); other proposers (prompt lookup) are charged the
running mean of their measured proposing time. Every verifying step is so expected to make more
tokens a second than the plain step it replaces. With ``T`` tokens the plain step
makes (a decode's, a finished prompt's), ``G`` the kept drafts expected and ``t_wide`` the
verifying shape's time (each of its decode slots ``1 + k`` tokens wide; not timed yet: the plain
shape's time, a lower bound), the step verifies when ``(T + G) * t_plain >= T * (t_wide + P)``.
Exploration: a verifying shape not timed yet is tried when that bound wins (the plain shape is
timed first once proposals have a cost); a verifying shape that lost ``RETRY_AFTER`` times in a
row is tried again (after twice as many losses each time it is retried and loses again), unless
it cannot win at all: when even every draft kept, in a step as fast as the plain one,
``(T + D) * t_plain < T * (t_plain + P)`` with ``D`` the drafts brought, the step runs plain and
nothing is retried (a model drafting for itself costs more than the tokens it saves). So
speculation turns itself off where drafts are rarely kept or where a wide step or the proposals
cost more than they bring (many rows on a busy CPU, a draft model as large as its target), and on
where they pay. Greedy output never depends on it; a seeded sampled request's tokens do (a
verified draft is kept with probability p(d), a plain step draws from p: the same distribution,
different draws), so for reproducible seeded sampling set ``always_verify``.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from pydantic import ConfigDict

from jaxkv.serving.kv_manager import KVCacheManager
from jaxkv.serving.requests import SequenceState
from jaxkv.serving.scheduler import Chunk

SPECULATIVE_METHODS = ("ngram", "draft")
MAX_NUM_TOKENS = 15  # drafts per step: the sequence's token and its drafts fit one query block


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """The engine's speculation (``EngineConfig.speculative``); each field's docstring says what it sets."""

    __pydantic_config__ = ConfigDict(extra="forbid")  # a config key that is no field is an error

    method: Literal[SPECULATIVE_METHODS] = "ngram"
    """'ngram' (prompt lookup over the sequence's own tokens) or 'draft' (a smaller model,
    ``draft_model``, with the target's vocabulary)."""
    num_tokens: int = 4
    """Drafts verified per step (``k``, 1 to ``MAX_NUM_TOKENS``)."""
    max_ngram: int = 4
    """ngram: the longest n-gram prompt lookup matches."""
    min_ngram: int = 2
    """ngram: the shortest n-gram prompt lookup matches."""
    always_verify: bool = False
    """Verify whatever drafts a step's sequences bring, without the measured rule of
    ``Speculation.plan`` (whether a step verifies then depends on nothing but each sequence's own
    tokens, so seeded sampling is reproducible)."""
    draft_model: object | None = None
    """'draft': the draft model (a ``DecoderModel``; in a config, its name, directory or .gguf,
    loaded by ``jaxkv.engine_args.load_engine``)."""

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

    def cost(self, seqs: Sequence[SequenceState], limits: Sequence[int]) -> float | None:
        """The seconds ``propose(seqs, limits)`` would take; None: not predicted (the rule then
        charges the running mean of the measured proposing time)."""
        return None


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


# The weight of the latest observation in the running means of step times and kept drafts.
SMOOTHING = 0.3
# A verifying shape that lost this many decisions in a row is tried once more (its time may have
# been measured on a busy machine); each retry that loses again doubles the wait.
RETRY_AFTER = 64
VERIFY, PLAIN, RETRY, WAIT = "verify", "plain", "retry", "wait"  # the rule's outcomes (WAIT: a loss counted)

Shape = tuple[int, int, int]  # a compiled step's (decode slots, prefill size, decode width)


@dataclasses.dataclass
class SpeculationStats:
    """A speculating engine's (or one request's) draft counters since start."""

    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of those, kept
    steps: int = 0  # sequence-steps that verified drafts

    @property
    def acceptance_rate(self) -> float:
        """``accepted / proposed`` (0 before any draft)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying sequence-step makes: 1 + its accepted drafts (0 before any)."""
        return 1 + self.accepted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        """The counters, the acceptance rate and the mean accepted length."""
        return {
            **dataclasses.asdict(self),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


class Speculation:
    """The engine's speculation stage: drafts for a step's decoding chunks when they pay (the
    module's rule), and what the step kept of them. ``kv`` grants the drafts' pages;
    ``max_model_len``: no draft reaches past it; ``step_shape(chunks, width)``: the compiled step
    shape that runs ``chunks`` with decode slots ``width`` tokens wide (``ModelRunner.step_shape``)."""

    def __init__(
        self, config: SpeculativeConfig, proposer: Proposer, kv: KVCacheManager, max_model_len: int,
        step_shape: Callable[[list[Chunk], int], Shape],
    ):  # fmt: skip
        self.config, self.proposer, self.kv, self.max_model_len = config, proposer, kv, max_model_len
        self.step_shape = step_shape
        self.stats = SpeculationStats()
        self.step_seconds: dict[Shape, float] = {}  # running mean of each step shape's wall time
        self.expected: dict[tuple[int, int], float] = {}  # running mean of a sequence's kept drafts
        self.prior = 1.0  # the same over every sequence: what a sequence not verified yet expects
        self.losses: dict[Shape, int] = {}  # decisions a verifying shape lost since it last won or was tried
        self.patience: dict[Shape, int] = {}  # losses before it is tried again (doubling per retry)
        self.proposing_mean: float | None = None  # running mean of the proposals' wall time over steps that proposed

    def plan(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` with drafts for the decoding sequences that get them, or unchanged when
        verifying them would not pay."""
        limits = {i: self._limit(chunk.seq) for i, chunk in enumerate(chunks) if self._decodes(chunk)}
        limits = {i: limit for i, limit in limits.items() if limit > 0}
        decision = self._decide(chunks, limits, self._proposal_cost(chunks, limits)) if limits else PLAIN
        if decision == PLAIN:
            return chunks
        start = time.perf_counter()
        proposals = self.proposer.propose([chunks[i].seq for i in limits], list(limits.values()))
        self.proposing_mean = running_mean(self.proposing_mean, time.perf_counter() - start)
        drafts = {
            i: tuple(draft[:limit])
            for (i, limit), draft in zip(limits.items(), proposals, strict=True)
            if draft and self.kv.allocate(chunks[i].seq, 1 + len(draft[:limit])) is not None
        }  # a draft's pages are granted without preempting anyone (and kept when the step does not verify)
        found = {i: len(draft) for i, draft in drafts.items()}
        if not drafts or (decision == VERIFY and self._outlook(chunks, found, 0.0) != VERIFY):
            return chunks  # the drafts found (their cost spent) do not pay; a retry verifies what it found
        return [dataclasses.replace(chunk, draft=drafts[i]) if i in drafts else chunk for i, chunk in enumerate(chunks)]

    @staticmethod
    def _decodes(chunk: Chunk) -> bool:
        """Is ``chunk`` a decode of a sequence that takes drafts?"""
        return chunk.count == 1 and chunk.draws_next and chunk.seq.options.speculative

    def _limit(self, seq: SequenceState) -> int:
        """Drafts ``seq`` may bring: ``num_tokens``, less than the tokens it may still make."""
        left = min(seq.options.max_tokens - len(seq.output), self.max_model_len - seq.num_tokens)
        return min(self.config.num_tokens, left - 1)

    def _proposal_cost(self, chunks: list[Chunk], limits: dict[int, int]) -> float | None:
        """``P`` of the module's rule for chunk i proposing up to ``limits[i]`` drafts: the
        proposer's prediction (a draft model's catch-up included, whole), or the running mean of
        the measured proposals (None: none yet) when the proposer predicts nothing."""
        predicted = self.proposer.cost([chunks[i].seq for i in limits], list(limits.values()))
        return self.proposing_mean if predicted is None else predicted

    def _decide(self, chunks: list[Chunk], drafts: dict[int, int], proposing: float | None) -> str:
        """VERIFY, PLAIN or RETRY (verify what the proposer finds: a losing shape's retry) for a
        step whose chunk i may bring ``drafts[i]`` drafts, proposals costing ``proposing``
        seconds: the module's rule, with its count of each verifying shape's losses."""
        wide = self.step_shape(chunks, 1 + self.config.num_tokens)
        outlook = self._outlook(chunks, drafts, proposing)
        if outlook == VERIFY:
            self.losses[wide], self.patience[wide] = 0, RETRY_AFTER
        if outlook != WAIT:
            return outlook
        self.losses[wide] = self.losses.get(wide, 0) + 1
        if self.losses[wide] < self.patience.get(wide, RETRY_AFTER):
            return PLAIN
        self.losses[wide], self.patience[wide] = 0, 2 * self.patience.get(wide, RETRY_AFTER)
        return RETRY

    def _outlook(self, chunks: list[Chunk], drafts: dict[int, int], proposing: float | None) -> str:
        """The module's rule for a step whose chunk i brings ``drafts[i]`` drafts, proposals
        costing ``proposing`` seconds (None: not known yet): VERIFY (it makes more tokens a second
        than the plain step, or it is to be timed), WAIT (its measured or bounded time loses) or
        PLAIN (it cannot win, or the plain shape is timed first); always VERIFY with ``always_verify``."""
        if self.config.always_verify:
            return VERIFY
        plain = self.step_seconds.get(self.step_shape(chunks, 1))
        wide = self.step_seconds.get(self.step_shape(chunks, 1 + self.config.num_tokens))
        if plain is None:
            return VERIFY if wide is None and not proposing else PLAIN
        proposing = proposing or 0.0
        tokens = sum(chunk.draws_next for chunk in chunks)
        if (tokens + sum(drafts.values())) * plain < tokens * (plain + proposing):
            return PLAIN
        gain = sum(min(self.expected.get(chunks[i].seq.key, self.prior), n) for i, n in drafts.items())
        wins = (tokens + gain) * plain >= tokens * ((plain if wide is None else wide) + proposing)
        return VERIFY if wins else WAIT

    def observe(self, chunks: list[Chunk], seconds: float) -> None:
        """A step ran ``chunks`` in ``seconds`` (wall time, proposals not included): update its
        shape's running mean."""
        verifying = any(chunk.draft for chunk in chunks)
        shape = self.step_shape(chunks, 1 + self.config.num_tokens if verifying else 1)
        self.step_seconds[shape] = running_mean(self.step_seconds.get(shape), seconds)

    def verified(self, chunk: Chunk, accepted: int) -> None:
        """The step kept ``accepted`` of ``chunk``'s drafts: count them and update the sequence's
        and the engine's running means."""
        if not chunk.draft:
            return
        seq = chunk.seq
        seq.num_proposed += len(chunk.draft)
        seq.num_accepted += accepted
        seq.num_speculative_steps += 1
        self.stats.proposed += len(chunk.draft)
        self.stats.accepted += accepted
        self.stats.steps += 1
        self.expected[seq.key] = running_mean(self.expected.get(seq.key), accepted)
        self.prior = running_mean(self.prior, accepted)

    def release(self, seq: SequenceState) -> None:
        """``seq`` finished or was aborted: forget its running mean and the proposer's record of it."""
        self.expected.pop(seq.key, None)
        self.proposer.release(seq)


def running_mean(mean: float | None, value: float) -> float:
    """The running mean ``mean`` (None: none yet) after ``value``."""
    return value if mean is None else (1 - SMOOTHING) * mean + SMOOTHING * value
