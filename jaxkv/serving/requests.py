"""What the engine knows about one request (each of its ``n`` sequences), what it hands back
after each step, and the error a refused request raises."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence

from jaxkv.decoding.sampling import GREEDY, Sampling


class RequestError(ValueError):
    """A request the engine refuses. ``param`` names the argument at fault (``"seed"``,
    ``"max_tokens"``, ...), so a server reports it without reading the message."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class RequestTypeError(RequestError, TypeError):
    """A request argument of the wrong type (also a ``TypeError``)."""


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted (its pages freed, to be recomputed)
    RUNNING = "running"  # holds a block-table row and pages
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True)
class RequestOptions:
    """What a caller asks of one request: the one definition of a request's options, passed as it
    is from the server (``Server.submit``) through ``EngineThread.submit`` and
    ``Engine.add_request`` to ``InputProcessor.process``, which checks every field (naming it)
    and returns the options the engine keeps with the sequence: ``stop_token_ids`` then holds the
    model's end-of-sequence tokens too (unless ``ignore_eos``), ``stop`` a tuple and ``seed`` an int."""

    sampling: Sampling = GREEDY
    max_tokens: int = 16
    stop_token_ids: Iterable[int] | None = None  # tokens that end it besides end-of-sequence (kept in the output)
    stop: Sequence[str] | str = ()  # stop strings: the text ends before the first one (needs a tokenizer)
    ignore_eos: bool = False  # the model's end-of-sequence tokens do not end it
    cache_salt: str | None = None  # only requests with the same salt share prefix pages (tenant isolation)
    seed: int | None = None  # in [0, 2**32); None: the engine seed plus the request id
    logprobs: int = 0  # top log-probabilities returned per token (0: only the chosen token's)
    n: int = 1  # sequences of the prompt; sequences 1.. fork from sequence 0 after its prefill
    speculative: bool = True  # may the engine's speculation draft tokens for it


@dataclasses.dataclass
class SequenceState:
    """One sequence of a request (one of its ``n`` completions) as the engine tracks it.

    ``tokens`` are the prompt then the outputs; ``num_computed`` of them are in the cache.
    The engine computes tokens until ``num_computed == len(tokens)``; the step that computes
    the last known token draws the next one. A preempted sequence keeps its outputs and is
    computed again from its prompt (or from the longest cached prefix)."""

    request_id: int
    index: int  # which of the request's n sequences
    prompt: list[int]
    options: RequestOptions
    arrival: float
    output: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    row: int | None = None  # block-table row while running
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # chain over full computed pages
    num_registered: int = 0  # pages already offered to the prefix cache
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (last admission)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_proposed: int = 0  # draft tokens verified for it (speculation)
    num_accepted: int = 0  # of those, the ones the target kept
    num_speculative_steps: int = 0  # steps that verified drafts for it

    @property
    def key(self) -> tuple[int, int]:
        """The owner name of this sequence's pages."""
        return (self.request_id, self.index)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one sequence: its new tokens (usually one; none for a prefill
    chunk), and whether and why it finished ('stop', 'length', 'abort', 'error').

    With a tokenizer, ``text`` is the whole output text so far (it ends before a stop string)
    and ``delta`` the text that became safe to send with this output: never a tail that may
    still turn into a stop string, nor a character split across tokens (the last output of a
    sequence sends the rest). ``logprobs``: one dict per new token,
    ``{"token": id, "logprob": x, "top": [(id, x), ...]}``. ``error``: why a request failed
    (finish reason 'error'). ``num_proposed`` / ``num_accepted`` / ``num_speculative_steps``: the
    sequence's speculation counters so far (``SequenceState``'s)."""

    request_id: int
    index: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    text: str = ""
    delta: str = ""
    logprobs: Sequence[dict] = ()
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    num_proposed: int = 0
    num_accepted: int = 0
    num_speculative_steps: int = 0


@dataclasses.dataclass(frozen=True)
class Completion:
    """A finished sequence (``Engine.generate_many``): all its tokens, text and finish reason."""

    request_id: int
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict]
    num_prompt_tokens: int
    num_cached_tokens: int
