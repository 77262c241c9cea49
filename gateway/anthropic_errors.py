"""kvgate's own errors on Anthropic's routes, in Anthropic's shape.

vLLM answers ``/v1/messages`` and ``/v1/messages/count_tokens`` with Anthropic-shaped errors
(``{"type": "error", "error": {"type": ..., "message": ...}}``), and the Anthropic SDK reads
that shape (the exception's ``type`` and message). kvgate's own errors there -- a bad key,
an unknown model, a limit, no replica -- take it too, with the same status and headers
(Retry-After, x-ratelimit-*) as on the OpenAI routes. A stream kvgate has to end itself (a
replica failing mid-stream, a timeout, shutdown) ends with Anthropic's ``error`` event, which
the SDK raises at, not OpenAI's ``data: {"error": ...}`` and ``data: [DONE]``, which it skips
as unknown events (the stream looked merely short) (`anthropic_stream`).
"""

from __future__ import annotations

import orjson

from gateway.asgi import Message, Send
from gateway.errors import KvgateError

__all__ = ["ANTHROPIC_PATHS", "anthropic_body", "anthropic_stream", "anthropic_type",
           "as_anthropic_events", "error_body"]

ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})

# Anthropic's error types by status (its API reference); 503 has no type of its own there:
# its "overloaded" is what a client retries later, as kvgate's 503s mean
_TYPES = {400: "invalid_request_error", 401: "authentication_error",
          403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
          529: "overloaded_error"}


def anthropic_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (``api_error`` for the rest)."""
    return _TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")


def error_body(path: str, exc: KvgateError) -> bytes:
    """`exc`'s body for a request to `path`: Anthropic's shape on its routes, else
    OpenAI's (`KvgateError.body`)."""
    return exc.body() if path not in ANTHROPIC_PATHS else anthropic_body(exc.status, exc.message)


def anthropic_body(status: int, message: str) -> bytes:
    """Anthropic's error body for `status` saying `message`."""
    return orjson.dumps({"type": "error", "error": {"type": anthropic_type(status),
                                                    "message": message}})


_ERROR_LINE = b'data: {"error"'  # kvgate's own error event (`gateway.stream_end`)
_DONE = b"data: [DONE]"
_TYPED_ERROR = b'data: {"type":"error"'


def anthropic_stream(send: Send) -> Send:
    """`send` for an Anthropic route: kvgate's OpenAI-shaped stream ending (an error event,
    then ``[DONE]``) rewritten as Anthropic's ``event: error``. A replica's own events are
    never such lines (Anthropic's carry ``event:`` names and a ``type``; generated text is
    JSON-escaped inside them), so only kvgate's are changed."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.body":
            body: bytes = message.get("body", b"")
            if _ends_as_openai(body):
                message = {**message, "body": _as_anthropic(body)}
        await send(message)

    return sending


def as_anthropic_events(body: bytes) -> bytes:
    """Stream bytes of an Anthropic route with kvgate's OpenAI-shaped ending rewritten as
    `anthropic_stream` does (the endpoint picker's stream chunks, which are no ASGI
    messages)."""
    return _as_anthropic(body) if _ends_as_openai(body) else body


def _ends_as_openai(body: bytes) -> bool:
    return body.startswith((_ERROR_LINE, _DONE)) or b"\n" + _ERROR_LINE in body \
        or b"\n" + _DONE in body


def _as_anthropic(body: bytes) -> bytes:
    out = []
    for event in body.split(b"\n\n"):
        if event.startswith(_DONE):
            continue
        if event.startswith(_ERROR_LINE):
            event = _error_event(event[len(b"data: "):])
        elif event.startswith(_TYPED_ERROR):  # a replica's Anthropic error as kvgate's last
            event = b"event: error\n" + event  # event (`stream_end.error_event`): named
        out.append(event)
    return b"\n\n".join(out)


def _error_event(data: bytes) -> bytes:
    try:
        error = orjson.loads(data)["error"]
        message, code = str(error["message"]), error.get("code")
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message, code = "The stream failed.", 502
    status = code if isinstance(code, int) else 502
    doc = {"type": "error", "error": {"type": anthropic_type(status), "message": message}}
    return b"event: error\ndata: " + orjson.dumps(doc)
