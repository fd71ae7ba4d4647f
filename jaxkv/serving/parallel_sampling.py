"""Parallel sampling (``n > 1``): a request's further sequences fork from its first once that
has computed the prompt, sharing its pages (``Scheduler.fork``), so the prompt is computed once."""

from __future__ import annotations

import dataclasses

from jaxkv.serving.requests import SequenceState
from jaxkv.serving.scheduler import Scheduler

MAX_COPIES = 8  # page copies (forks) per pool per step; more forks wait a step


def _awaits_fork(family: list[SequenceState]) -> bool:
    """A first sequence with its prompt computed, and fewer sequences than asked."""
    first = family[0]
    return len(family) < first.options.n and first.num_computed >= len(first.prompt)


@dataclasses.dataclass(frozen=True)
class Forks:
    """This step's new sequences and the page copies ``(source, destination)`` per pool name
    that must happen before the next step writes (empty lists: none)."""

    children: list[SequenceState]
    copies: dict[str, list[tuple[int, int]]]


def fork_sequences(scheduler: Scheduler, families: dict[int, list[SequenceState]], can_share: bool) -> Forks:
    """Start the further sequences of requests whose first sequence has just computed its
    prompt: each forks from it or, when rows, pages or this step's copy slots are short (or
    ``can_share`` is False: per-row state cannot be forked), waits to be computed like a new
    request. Appends each child to its ``families`` entry."""
    pairs: dict[str, list[tuple[int, int]]] = {}
    children = []
    for first in list(scheduler.running):
        if first.index != 0:
            continue
        family = families[first.request_id]
        while _awaits_fork(family):
            child = SequenceState(first.request_id, len(family), first.prompt, first.options, first.arrival)
            family.append(child)
            children.append(child)
            room = can_share and all(len(p) < MAX_COPIES for p in pairs.values())  # a fork copies <= 1 page a pool
            copies = scheduler.fork(first, child) if room else None
            if copies is None:
                scheduler.waiting.appendleft(child)
                continue
            for name, found in copies.items():
                pairs.setdefault(name, []).extend(found)
    return Forks(children, pairs)
