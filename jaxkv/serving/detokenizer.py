"""A sequence's output text as its tokens arrive: incremental detokenizing, stop strings and
the hold-back of text that may still become a stop string.

Decoding a sequence's whole output at every step costs its length each step (quadratic over
the sequence). ``IncrementalDetokenizer`` decodes only a window: the tokens since the last
emitted text plus a few before them for context (vLLM's ``prefix_offset``/``read_offset``),
so a step costs what its new tokens cost. ``SequenceText`` adds the stop strings: it looks for
them only where new text can complete one, and holds back a tail that may still become one,
with work bounded by the text not yet sent (a million-character stop string costs no more
than a short one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT = "\ufffd"  # what a decoder yields for a character split across tokens
CONTEXT_TOKENS = 5  # tokens before the new ones that each window decodes for context


class Decoder(Protocol):
    def decode(self, ids: Sequence[int]) -> str: ...


class IncrementalDetokenizer:
    """Text of ``tokens`` appended one by one. ``append`` returns the new text, which is empty
    while the last tokens end inside a character (U+FFFD); ``flush`` returns whatever is left."""

    def __init__(self, tokenizer: Decoder):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # window start: context decoded before the new tokens
        self.read_offset = 0  # tokens up to here have been emitted as text

    def append(self, token: int) -> str:
        self.tokens.append(token)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text of the tokens not emitted yet (a trailing split character included)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        before = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset])
        after = self.tokenizer.decode(self.tokens[self.prefix_offset :])
        if not final and (len(after) <= len(before) or after.endswith(REPLACEMENT)):
            return ""
        self.prefix_offset = max(0, min(self.read_offset, len(self.tokens) - CONTEXT_TOKENS))
        self.read_offset = len(self.tokens)
        return after[len(before) :]


class SequenceText:
    """One sequence's text with its stop strings: ``text`` ends before the first stop string
    found; ``delta`` hands out what is safe to send."""

    def __init__(self, tokenizer: Decoder, stops: Sequence[str]):
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stops = tuple(stops)
        self.text = ""
        self.num_sent = 0  # characters of ``text`` already handed out by ``delta``
        self.stopped = False  # a stop string was found: the text is final

    def append(self, token: int) -> bool:
        """Add a token's text; True if a stop string appeared (``text`` is cut before it)."""
        return self._extend(self.detokenizer.append(token))

    def finish(self) -> None:
        """The sequence ended: take in the text still held by the detokenizer."""
        self._extend(self.detokenizer.flush())

    def _extend(self, new: str) -> bool:
        if not new or self.stopped:
            return self.stopped
        start = len(self.text)
        self.text += new
        # A match starts at or after num_sent (a tail that could begin one is never sent), and ends in ``new``.
        found = [
            at for stop in self.stops if (at := self.text.find(stop, max(self.num_sent, start - len(stop) + 1))) >= 0
        ]
        if not found:
            return False
        self.text, self.stopped = self.text[: min(found)], True
        return True

    def delta(self, finished: bool) -> str:
        """Text not handed out before: all of it once ``finished``, else all but a tail that
        is the start of some stop string."""
        end = len(self.text) if finished else len(self.text) - self._held()
        new = self.text[self.num_sent : end]
        self.num_sent = max(self.num_sent, end)
        return new

    def _held(self) -> int:
        """Length of the longest unsent tail that is a proper prefix of a stop string."""
        unsent = self.text[self.num_sent :]
        held = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(unsent)), held, -1):
                if stop.startswith(unsent[len(unsent) - length :]):
                    held = length
                    break
        return held
