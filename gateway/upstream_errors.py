"""A replica's error body in OpenAI's shape: what kvgate relays when vLLM (or the server in
front of it) answers an error that is not already ``{"error": {"message", ...}}`` -- older
vLLM's flat errors, FastAPI's ``{"detail": ...}`` and its 422 validation lists, a bare string,
a page of text. Used by both edges (the HTTP proxy and the Envoy picker) and stored responses.
"""

from __future__ import annotations

import re

import orjson

from gateway.anthropic_errors import ANTHROPIC_PATHS, anthropic_body
from gateway.errors import UpstreamError, error_body, type_for, unserved_route
from gateway.sse import error_message

__all__ = ["ANSWERED_AN_ERROR", "encoded", "error_in_success", "model_sleeping", "openai_shaped",
           "unreadable", "without_salt"]

ANSWERED_AN_ERROR = "The replica answered an error with a 200: "  # + its message

# a JSON error object, nested or flat (`openai_shaped`), or Anthropic's (``{"type": "error",
# "error": ...}``): its first key says so (every answer of vLLM's routes opens with another:
# "id", "object", ...; an Anthropic message's "type" is "message")
_OPENS_ERROR = re.compile(
    rb'\s*\{\s*"(?:error"\s*:|object"\s*:\s*"error"|type"\s*:\s*"error"\s*,\s*"error"\s*:)')
_ERROR_BYTES = 64 * 1024  # an error object is small: a larger body is no error read here


# a `cache_salt` value an error echoes: vLLM's 400 for a request-level validator (e.g. stream
# options without a stream) is FastAPI's str(exc), each error's `input` the whole body, the
# tenant's salt included, as a Python repr ('cache_salt': '...') or JSON ("cache_salt": "...",
# escaped inside a message); and VLLMValidationError's "(parameter=cache_salt, value=...)"
_SALT_ECHO = re.compile(
    rb"""(cache_salt(?:\\?['"]\s*:\s*\\?['"]|, value=))[^'"\\),\s]+""")


# a salt as kvgate derives it (`gateway.tenancy.salt`): 43 base64url characters or 64 hex
# digits, standing alone. An error that names cache_salt may echo its value in shapes no
# pattern of the key before it covers (escaped twice, `cache_salt = '...'`, the value in a
# neighbouring field): every such token of it is hidden.
_SALT_SHAPED = re.compile(
    rb"(?<![A-Za-z0-9_-])(?:[A-Za-z0-9_-]{43}|[0-9a-fA-F]{64})(?![A-Za-z0-9_-])")


def without_salt(body: bytes) -> bytes:
    """`body` with any `cache_salt` value it echoes replaced by ``***``: the salt is a secret
    derivation of the gateway's, never shown to a client (its own tenant's either)."""
    if b"cache_salt" not in body:
        return body
    hidden, n = _SALT_ECHO.subn(rb"\1***", body)
    hidden, m = _SALT_SHAPED.subn(b"***", hidden)
    return hidden if n or m else body


# of FastAPI's validation errors (`{"detail": [...]}`), the first few are named, each cut
_SHOWN_ERRORS, _FIELD_CHARS, _MSG_CHARS = 3, 60, 90  # (under the 500 characters kept)


def _validation_errors(detail: list[object]) -> tuple[str | None, str | None]:
    """FastAPI's 422 ``{"detail": [{"loc", "msg", "type", "input"}, ...]}`` (pydantic's
    errors, as a vLLM route without vLLM's own handler answers them) as one message naming
    each field and what is wrong with it, and the first field as `param`. Never ``input``
    (it may echo prompt text). (None, None) when it is not that shape."""
    parts: list[str] = []
    first: str | None = None
    for item in detail:
        if not isinstance(item, dict) or not isinstance(item.get("msg"), str):
            return None, None
        loc = item.get("loc")
        names = [str(p) for p in loc if p not in ("body", "query", "path")] if isinstance(
            loc, list) else []
        field = ".".join(names)[:_FIELD_CHARS] or None
        first = first or field
        if len(parts) < _SHOWN_ERRORS:
            msg = item["msg"][:_MSG_CHARS]
            parts.append(f"{field}: {msg}" if field else msg)
    if not parts:
        return None, None
    n = len(detail)
    more = f" (and {n - _SHOWN_ERRORS} more)" if n > _SHOWN_ERRORS else ""
    return f"{n} validation error{'s' if n > 1 else ''}: {'; '.join(parts)}{more}", first


def openai_shaped(status: int, body: bytes, path: str | None = None) -> bytes | None:
    """An upstream error body in OpenAI's shape, or None when it already is one.

    vLLM >= 0.10.1 answers ``{"error": {"message", "type", "param", "code"}}`` (kept as is);
    older vLLM the flat ``{"object": "error", ...}`` (nested); anything else -- FastAPI's
    ``{"detail": ...}`` (a list of validation errors: each field named, `param` the
    first), vLLM's auth ``{"error": "Unauthorized"}``, a text/plain page of a
    dying server -- is replaced by an OpenAI error with the same status. The upstream text is
    kept only when it is a short JSON string (never a raw page: it may hold a traceback).
    FastAPI's bare 404 on a proxied route (`path`) is vLLM without that route for its model
    (`unserved_route`), said so rather than "Not Found". On Anthropic's routes (`path`) the
    error replaced is in Anthropic's shape: kvgate's words there, as its own errors are (the
    Anthropic SDK reads ``type``); a replica's JSON error object is kept as it is."""
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    message: object = None
    type_ = type_for(status)
    param = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            hidden = without_salt(body)  # (a message echoing the body: `_SALT_ECHO`)
            return None if hidden is body else hidden
        if data.get("object") == "error" and isinstance(data.get("message"), str):
            message, param = data["message"], data.get("param")
            type_ = data["type"] if isinstance(data.get("type"), str) else type_
        elif isinstance(err, str):
            message = err
        elif isinstance(data.get("detail"), str):
            message = data["detail"]
            if status == 404 and message == "Not Found" and path is not None:
                message, param = unserved_route(path), "model"
        elif isinstance(data.get("detail"), list):
            message, param = _validation_errors(data["detail"])
    if not isinstance(message, str) or not message or len(message) > 500:
        message = f"The upstream replica answered {status}."
    message = _masked(message)
    if path in ANTHROPIC_PATHS:
        return anthropic_body(status, message)
    return error_body(message, type_, status, param if isinstance(param, str) else None)


def error_in_success(body: bytes) -> str | None:
    """The message of a JSON error object answered with a 200 (a proxy's error in front of a
    replica, kept in its own shape), else None: relayed, the SDK returned a completion of
    nothing (``choices=None``) and said nothing of the error. Both whole-answer relays (the
    proxied and the stored)."""
    if len(body) > _ERROR_BYTES or not _OPENS_ERROR.match(body):
        return None
    message = error_message(body)
    return None if message is None else _masked(message)


def _masked(message: str) -> str:
    """`without_salt` of a message (lone surrogates, which JSON escapes can make, kept)."""
    return without_salt(message.encode("utf-8", "surrogatepass")).decode(
        "utf-8", "surrogatepass")


# older vLLM's 503 for a request to a sleeping engine: its error's type (ModelSleepingError)
# or its message saying the model is sleeping
_SLEEPING = re.compile(rb"SleepingError|\b[Ii]s (?:currently )?(?:asleep|sleeping)\b")


def model_sleeping(status: int, body: bytes) -> bool:
    """vLLM's 503 for a sleeping model: the replica is asleep, not failing."""
    return status == 503 and len(body) <= _ERROR_BYTES and _SLEEPING.search(body) is not None


def unreadable(why: str) -> UpstreamError:
    """The 502 of an answer kvgate cannot read (`why`: not HTTP it reads, a compressed one),
    both edges alike."""
    return UpstreamError(f"The replica's answer was not readable ({why}).", reason="unreadable")


def encoded(coding: bytes) -> str:
    """Why an answer with this ``Content-Encoding`` is not read: every request asks for
    identity (a proxy that compresses anyway sent bytes kvgate can neither read nor relay as
    the JSON or the events they claim to be)."""
    return f"an answer in {coding[:32].decode('latin-1').strip()} encoding"
