"""Output processing: after a step, each drawn token appended to its sequence, its text
extended (``jaxkv.serving.detokenizer``), its finish checked, and its ``RequestOutput`` built."""

from __future__ import annotations

import time

from jaxkv.serving.detokenizer import Decoder, SequenceText
from jaxkv.serving.requests import Completion, RequestOutput, SequenceState


def _token_logprobs(token: int, logprob: float, top_tokens, top_logprobs, num_top: int) -> dict:
    top = [(int(t), float(x)) for t, x in zip(top_tokens[:num_top], top_logprobs[:num_top])]
    return {"token": token, "logprob": float(logprob), "top": top}


class OutputProcessor:
    """Turns drawn tokens into outputs. ``tokenizer``: anything with ``decode(ids) -> str``
    (None: no text, no stop strings); ``max_model_len``: a sequence stops there ('length')."""

    def __init__(self, tokenizer: Decoder | None, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.texts: dict[tuple[int, int], SequenceText] = {}  # by sequence key, until forgotten

    def add(self, seq: SequenceState) -> None:
        """Start following a new sequence's text."""
        if self.tokenizer is not None:
            self.texts[seq.key] = SequenceText(self.tokenizer, seq.options.stop)

    def append(self, seq: SequenceState, token: int, logprob: float, top_tokens, top_logprobs) -> str | None:
        """Add ``token`` (with its log-probability and the top alternatives ``[M]``) to ``seq``;
        returns its finish reason: 'stop' on a stop token or string, 'length' at ``max_tokens``
        or the model's length, else None."""
        seq.output.append(token)
        seq.logprobs.append(_token_logprobs(token, logprob, top_tokens, top_logprobs, seq.options.logprobs))
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        text = self.texts.get(seq.key)
        if text is not None and text.append(token):
            return "stop"
        if token in seq.options.stop_token_ids:
            return "stop"
        if len(seq.output) >= seq.options.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finished(self, seq: SequenceState, reason: str) -> None:
        """Mark ``seq`` finished; the text the detokenizer still held joins it (a stop string cuts it)."""
        seq.finish_reason, seq.finish_time = reason, time.perf_counter()
        text = self.texts.get(seq.key)
        if text is not None:
            text.finish()

    def output(self, seq: SequenceState, new: list[int], error: str | None = None) -> RequestOutput:
        """What this step produced for ``seq``: its ``new`` tokens, text and finish."""
        text = self.texts.get(seq.key)
        return RequestOutput(
            request_id=seq.request_id, index=seq.index, new_token_ids=new, finished=seq.finished,
            finish_reason=seq.finish_reason, text="" if text is None else text.text,
            delta="" if text is None else text.delta(seq.finished),
            logprobs=seq.logprobs[len(seq.logprobs) - len(new) :], num_prompt_tokens=len(seq.prompt),
            num_cached_tokens=seq.num_cached_tokens, error=error, num_proposed=seq.num_proposed,
            num_accepted=seq.num_accepted, num_speculative_steps=seq.num_speculative_steps,
        )  # fmt: skip

    def completion(self, seq: SequenceState) -> Completion:
        """A finished sequence whole."""
        text = self.texts.get(seq.key)
        return Completion(
            request_id=seq.request_id, index=seq.index, token_ids=list(seq.output),
            text="" if text is None else text.text, finish_reason=seq.finish_reason or "",
            logprobs=list(seq.logprobs), num_prompt_tokens=len(seq.prompt), num_cached_tokens=seq.num_cached_tokens,
        )  # fmt: skip

    def forget(self, seq: SequenceState) -> None:
        self.texts.pop(seq.key, None)
