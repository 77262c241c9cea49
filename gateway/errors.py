"""One exception hierarchy for everything kvgate itself rejects, rendered once as OpenAI JSON.

The body shape is vLLM's and OpenAI's: ``{"error": {"message", "type", "param", "code"}}``.
Messages are written by us and never contain prompt text, keys, salts or tracebacks.
Tenancy's errors (authentication, rate limits, admin API) subclass `KvgateError` in
`gateway.tenancy.errors` with the same `type` vocabulary (``AuthenticationError``,
``RateLimitError``, ...), so the proxy renders every error it raises through this one base.
"""

from __future__ import annotations

import orjson

__all__ = [
    "BadRequest",
    "BodyTooLarge",
    "ConfigError",
    "KvgateError",
    "ModelNotFound",
    "NoReplicaAvailable",
    "NotFound",
    "RetryBudgetExhausted",
    "UpstreamError",
    "UpstreamTimeout",
    "error_body",
    "openai_shaped",
]


def error_body(message: str, type_: str, code: int | str | None, param: str | None = None) -> bytes:
    error = {"message": message, "type": type_, "param": param, "code": code}
    return orjson.dumps({"error": error})


class KvgateError(Exception):
    """Base: an error kvgate answers itself. Subclasses fix the status and the OpenAI type."""

    status: int = 500
    type_: str = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> bytes:
        return error_body(self.message, self.type_, self.status, self.param)

    def headers(self) -> list[tuple[bytes, bytes]]:
        hdrs = [(b"content-type", b"application/json")]
        if self.retry_after is not None:
            hdrs.append((b"retry-after", str(self.retry_after).encode()))
        return hdrs


class ConfigError(KvgateError):
    """Invalid configuration at start-up; the message names the field."""


class BadRequest(KvgateError):
    status = 400
    type_ = "BadRequestError"


class NotFound(KvgateError):
    status = 404
    type_ = "NotFoundError"


class ModelNotFound(NotFound):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class BodyTooLarge(KvgateError):
    status = 413
    type_ = "RequestEntityTooLargeError"


class UpstreamError(KvgateError):
    """The chosen replicas failed before answering (connect error, reset, 5xx)."""

    status = 502
    type_ = "BadGatewayError"

    def __init__(self, message: str, *, reason: str = "error") -> None:
        super().__init__(message)
        self.reason = reason  # short label for metrics: "connect", "status_503", ...


class UpstreamTimeout(UpstreamError):
    """A first-byte, idle or total timeout (`code` 504, `type` says timeout)."""

    status = 504
    type_ = "GatewayTimeoutError"

    def __init__(self, message: str, *, reason: str = "timeout") -> None:
        super().__init__(message, reason=reason)


class RetryBudgetExhausted(UpstreamError):
    """Replicas answered busy/failed and the pool's retry budget allows no further attempt:
    503 with Retry-After (a client may try again shortly), not a 502."""

    status = 503
    type_ = "ServiceUnavailableError"

    def __init__(self, message: str, *, reason: str = "retry_budget") -> None:
        super().__init__(message, reason=reason)
        self.retry_after = 1


class NoReplicaAvailable(KvgateError):
    status = 503
    type_ = "ServiceUnavailableError"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, retry_after=retry_after)


# HTTP status -> OpenAI/vLLM error type, for upstream errors kvgate has to re-shape
_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
          413: "RequestEntityTooLargeError", 422: "UnprocessableEntityError",
          429: "RateLimitError", 500: "InternalServerError", 501: "NotImplementedError",
          502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def openai_shaped(status: int, body: bytes) -> bytes | None:
    """An upstream error body in OpenAI's shape, or None when it already is one.

    vLLM >= 0.10.1 answers ``{"error": {"message", "type", "param", "code"}}`` (kept as is);
    older vLLM the flat ``{"object": "error", ...}`` (nested); anything else -- FastAPI's
    ``{"detail": ...}``, vLLM's auth ``{"error": "Unauthorized"}``, a text/plain page of a
    dying server -- is replaced by an OpenAI error with the same status. The upstream text is
    kept only when it is a short JSON string (never a raw page: it may hold a traceback)."""
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        data = None
    message: object = None
    type_ = _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    param = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return None
        if data.get("object") == "error" and isinstance(data.get("message"), str):
            message, param = data["message"], data.get("param")
            type_ = data["type"] if isinstance(data.get("type"), str) else type_
        elif isinstance(err, str):
            message = err
        elif isinstance(data.get("detail"), str):
            message = data["detail"]
    if not isinstance(message, str) or not message or len(message) > 500:
        message = f"The upstream replica answered {status}."
    return error_body(message, type_, status, param if isinstance(param, str) else None)
