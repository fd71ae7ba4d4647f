"""The request bodies of ``jaxkv serve`` (pydantic): OpenAI's fields and the vLLM extensions
that load tools send, each with its bounds, so a bad value is a 400 naming the field before
anything reaches the engine.

Bounds a client meets here, not in OpenAI's reference: ``temperature`` in ``[0, 2]`` (OpenAI's
documented range; finite), ``seed`` in ``[0, 2**32)`` (the engine's random stream is keyed by
a uint32), ``top_k`` up to ``2**31 - 1`` (-1 or 0: every token), at most ``MAX_STOP_STRINGS``
stop strings of at most ``MAX_STOP_LENGTH`` characters, and text that is valid Unicode (a lone
UTF-16 surrogate such as ``"\\ud800"`` is refused: no tokenizer can encode it).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from jaxkv.decoding.sampling import MAX_TOP_K, Sampling
from jaxkv.serving.input_processor import MAX_SEED
from jaxkv.serving.requests import RequestOptions

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_LENGTH = 256  # characters; what the stream holds back per chunk grows with it
# Sampling options of vLLM and OpenAI this server does not implement: accepted at the value
# that has no effect (clients send the default explicitly), refused otherwise.
NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}


def _valid_unicode(text: str) -> str:
    """``text`` if it encodes as UTF-8 (no lone surrogate), else a ValueError saying where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"text must be valid Unicode: lone surrogate U+{ord(text[error.start]):04X} at index {error.start}"
        ) from None
    return text


def _listed(value: Any) -> Any:
    """One stop string stands for a list of one."""
    return [value] if isinstance(value, str) else value


Text = Annotated[str, AfterValidator(_valid_unicode)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH), AfterValidator(_valid_unicode)]
StopStrings = Annotated[list[StopString], BeforeValidator(_listed), Field(max_length=MAX_STOP_STRINGS)]


class Body(BaseModel):
    """A request body: an unknown field is an error naming it, no value is converted from
    another JSON type (``"2"`` is not an int, ``1`` not a bool), and no float is NaN or infinite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, usage in every chunk


class CommonParams(Body):
    """The fields both endpoints take. ``API_FIELDS``: the field a client set for each
    ``Engine.add_request`` argument a ``RequestError`` may name."""

    API_FIELDS: ClassVar[dict[str, str]] = {}

    model: Text
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # 0 or -1 (vLLM's): all tokens
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: StopStrings | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's: generate past the end-of-sequence token (fixed-length load tests)
    cache_salt: Text | None = None  # only requests with the same salt share prefix pages
    speculative: bool = True  # jaxkv's: false keeps the server's speculative decoding from drafting for it
    user: Text | None = None
    frequency_penalty: float = NEUTRAL["frequency_penalty"]
    presence_penalty: float = NEUTRAL["presence_penalty"]
    repetition_penalty: float = NEUTRAL["repetition_penalty"]
    min_tokens: int = NEUTRAL["min_tokens"]

    @field_validator(*NEUTRAL)
    @classmethod
    def _only_neutral(cls, value, info: ValidationInfo):
        neutral = NEUTRAL[info.field_name]
        if value != neutral:
            raise ValueError(f"not supported by this server; only {neutral} (no effect) is accepted")
        return value

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, max(self.top_k, 0), self.top_p, self.min_p)

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    def token_limit(self) -> int | None:
        """The output tokens the client asked for (None: the endpoint's default)."""
        return self.max_tokens

    def request_options(self, default_max_tokens: int) -> RequestOptions:
        """The engine's options for this body (``default_max_tokens`` when it sets no limit)."""
        limit = self.token_limit()
        return RequestOptions(
            sampling=self.sampling(), max_tokens=default_max_tokens if limit is None else limit, stop=self.stops(),
            ignore_eos=self.ignore_eos, seed=self.seed, cache_salt=self.cache_salt, n=self.n,
            logprobs=self.num_logprobs(), speculative=self.speculative,
        )  # fmt: skip

    def api_field(self, param: str | None) -> str | None:
        """The body field an engine argument named by a ``RequestError`` came from."""
        return self.API_FIELDS.get(param, param)

    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM: ``include_usage`` and ``continuous_usage_stats``)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class CompletionRequest(CommonParams):
    API_FIELDS: ClassVar[dict[str, str]] = {"prompt_ids": "prompt"}

    prompt: Text | list[int]
    logprobs: int | None = Field(None, ge=0)

    def num_logprobs(self) -> int:
        return self.logprobs or 0


class TextPart(Body):
    """A part of a message's ``content`` list; only text parts are taken."""

    type: Literal["text"]
    text: Text

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        if isinstance(data, dict) and data.get("type") != "text":
            raise ValueError(
                f"content part type {data.get('type')!r} is not supported: this server takes text parts only "
                '({"type": "text", "text": ...})'
            )
        return data


class ChatMessage(Body):
    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class ChatRequest(CommonParams):
    API_FIELDS: ClassVar[dict[str, str]] = {"prompt_ids": "messages", "logprobs": "top_logprobs"}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)  # OpenAI's current name; max_tokens is its alias
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)

    @field_validator("max_completion_tokens")
    @classmethod
    def _not_both(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("max_tokens") is not None:
            raise ValueError(
                "max_tokens and max_completion_tokens are both set; send one (max_tokens is the deprecated alias)"
            )
        return value

    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def api_field(self, param: str | None) -> str | None:
        if param == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return super().api_field(param)

    def num_logprobs(self) -> int:
        return self.top_logprobs or 0

    def chat(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


FIELD_NAMES = frozenset(
    name
    for model in (CompletionRequest, ChatRequest, ChatMessage, TextPart, StreamOptions)
    for name in model.model_fields
)
"""Every field name of the bodies: what a validation error's location is read against (the
other parts of a location are pydantic's tags for a union's members)."""
