"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every
way a request can fail: a body not declared as JSON (415), too large, not UTF-8, not JSON (or
nested too deeply to parse), or not a valid request (the field named as ``param``); an unknown
path (404) or method (405); a refusal by the engine; a bug (500, no traceback). A client that
disconnects is no error: its request ends with an empty 499 that nobody reads.

The body is read and parsed here rather than by FastAPI, so that each of these is a 4xx
naming what is wrong, never a 500 or a framework's ``{"detail": ...}``.
"""

from __future__ import annotations

import codecs
import json
from email.message import Message
from email.utils import collapse_rfc2231_value
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from jaxkv.server.schemas import FIELD_NAMES

MAX_BODY_BYTES = 8 * 2**20  # a prompt of a model's whole context is a few hundred KiB
JSON_TYPE = "application/json"  # the one Content-Type a POST body may have (any parameters, a UTF-8 charset)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client left before the answer
ENDPOINTS = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"

B = TypeVar("B", bound=BaseModel)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class ClientDisconnected(Exception):
    """The client closed its connection before its answer (``Server.outputs`` raises it, having
    aborted the request and logged it): an ordinary event, not a fault."""


def error_body(message: str, param: str | None, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def error_response(status: int, message: str, param: str | None, kind: str, headers=None) -> Response:
    """The error as JSON; non-ASCII is escaped, so text a client sent (a lone surrogate in a
    field name) cannot break the encoding of the answer."""
    return Response(json.dumps(error_body(message, param, kind)), status, headers, media_type="application/json")


async def read_json(request: Request):
    """The request's JSON body: its Content-Type checked before a byte of it is read (a 415),
    then read (``read_body``) and parsed (``parse_json``)."""
    _require_json(request.headers.getlist("content-type"))
    return parse_json(await read_body(request))


def _require_json(content_types: list[str]) -> None:
    """A 415 naming the Content-Type received unless there is exactly one, ``application/json``
    (case-insensitive, any parameters) with no charset or UTF-8 (JSON is UTF-8).

    Every other type is refused, a missing one too: a web page can make a visitor's browser
    send a POST to a server on localhost without a CORS preflight only with a text/plain, form
    or multipart Content-Type, or with none (``fetch`` of a Blob body), so a server that ran
    such a body would run any page's request."""
    if not content_types:
        raise APIError(415, f"the request has no Content-Type; its body must be JSON, sent as {JSON_TYPE}")
    if len(content_types) > 1:
        received = ", ".join(repr(value) for value in content_types)
        raise APIError(415, f"the request has {len(content_types)} Content-Types ({received}); send one, {JSON_TYPE}")
    (received,) = content_types
    # The standard library's parser of MIME types and their parameters (its lenient compat32
    # form: EmailMessage's stricter parser raises IndexError on some malformed parameters).
    header = Message()
    header["content-type"] = received
    if header.get_content_type() != JSON_TYPE:
        raise APIError(415, f"Content-Type {received!r} is not accepted: the body must be JSON, sent as {JSON_TYPE}")
    charset = header.get_param("charset")
    if charset is not None and _codec_name(collapse_rfc2231_value(charset)) != "utf-8":
        raise APIError(
            415, f"Content-Type {received!r} is not accepted: JSON is UTF-8; send {JSON_TYPE} (charset=utf-8 or none)"
        )


def _codec_name(charset: str) -> str | None:
    """Python's name of the codec ``charset`` names (``utf8``, ``UTF-8``: ``utf-8``); None if it knows none."""
    try:
        return codecs.lookup(charset).name
    except LookupError:
        return None


async def read_body(request: Request) -> bytes:
    """The request's bytes; past ``MAX_BODY_BYTES`` a 413 (read no further)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is {declared} bytes; this server takes at most {MAX_BODY_BYTES}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the body is over {MAX_BODY_BYTES} bytes, the most this server takes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes):
    """The body's JSON value; a 400 if it is not UTF-8, not JSON, or nested too deeply."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(400, f"the body is not UTF-8: byte 0x{raw[error.start]:02x} at offset {error.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise APIError(
            400, f"the body is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        ) from None
    except RecursionError:
        raise APIError(400, "the body is not valid JSON for this server: it nests too deeply") from None
    except ValueError as error:  # e.g. an integer of more digits than Python converts
        raise APIError(400, f"the body is not valid JSON for this server: {error}") from None


def _param(error: dict) -> str | None:
    """A validation error's location as a field path (``messages.0.content``), without the
    tags pydantic adds for a union's members; an unknown field ends the path."""
    *path, last = error["loc"] or (None,)
    parts = [part for part in path if isinstance(part, int) or part in FIELD_NAMES]
    if last is not None and (error["type"] == "extra_forbidden" or isinstance(last, int) or last in FIELD_NAMES):
        parts.append(last)
    return ".".join(str(part) for part in parts) or None


def validated(model: type[B], value) -> B:
    """``value`` as a ``model``; a 400 naming the first field at fault, at its most specific
    (for a field of several forms, the error of the form that got furthest)."""
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise _invalid(error.errors(include_url=False, include_input=False)) from None


def _invalid(errors: list[dict]) -> APIError:
    same_field = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
    # A union reports each form's error: a wrong type for the forms the value is not, a finer one for the form it is.
    specific = [e for e in same_field if not e["type"].endswith("_type")] or same_field
    param = max((_param(e) for e in specific), key=lambda p: len(p or ""))
    reasons = dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in specific if _param(e) == param)
    return APIError(400, f"{param or 'body'}: {'; or '.join(reasons)}", param)


def install_handlers(app: FastAPI, count) -> None:
    """Answer every error in OpenAI's shape; ``count(status)`` records each."""

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        count(error.status)
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return error_response(error.status, error.message, error.param, error.kind, headers)

    async def routing_error(request: Request, error):
        """The framework's own: an unknown path (404), a method a path does not take (405)."""
        count(error.status_code)
        where = f"{request.method} {request.url.path}"
        if error.status_code == 404:
            return error_response(
                404, f"{where}: no such endpoint; this server serves {ENDPOINTS}", None, "not_found_error"
            )
        allowed = error.headers["Allow"]
        message = f"{where}: this path does not take {request.method}; it takes {allowed}"
        return error_response(405, message, None, "invalid_request_error", error.headers)

    for status in (404, 405):
        app.add_exception_handler(status, routing_error)

    @app.exception_handler(ClientDisconnected)
    async def client_disconnected(_, error: ClientDisconnected):
        """An empty 499, sent to nobody: the request was aborted, counted and logged where the
        disconnect was found, and an exception escaping the app would be logged as a fault."""
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def internal(_, error: Exception):
        """A bug still answers in OpenAI's shape, without a traceback (uvicorn logs it)."""
        count(500)
        return error_response(500, f"internal error: {type(error).__name__}", None, "server_error")
