"""kvgate's own errors on Anthropic's routes, in Anthropic's shape.

vLLM answers ``/v1/messages`` and ``/v1/messages/count_tokens`` with Anthropic-shaped errors
(``{"type": "error", "error": {"type": ..., "message": ...}}``), and the Anthropic SDK reads
that shape (the exception's ``type`` and message). kvgate's own errors there -- a bad key,
an unknown model, a limit, no replica -- take it too, with the same status and headers
(Retry-After, x-ratelimit-*) as on the OpenAI routes.
"""

from __future__ import annotations

import orjson

from gateway.errors import KvgateError

__all__ = ["ANTHROPIC_PATHS", "anthropic_type", "error_body"]

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
    if path not in ANTHROPIC_PATHS:
        return exc.body()
    return orjson.dumps({"type": "error", "error": {"type": anthropic_type(exc.status),
                                                    "message": exc.message}})
