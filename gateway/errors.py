"""One exception hierarchy for everything kvgate itself rejects, rendered once as OpenAI JSON.

The body shape is vLLM's and OpenAI's: ``{"error": {"message", "type", "param", "code"}}``.
Messages are written by us and never contain prompt text, keys, salts or tracebacks.
Tenancy's errors (authentication, rate limits, admin API) subclass `KvgateError` in
`gateway.tenancy.errors` with OpenAI's lower-case types (``authentication_error``, ...), so the
proxy renders every error it raises through this one base.
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
    "UpstreamError",
    "UpstreamTimeout",
    "error_body",
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
    status = 504
    type_ = "GatewayTimeoutError"


class NoReplicaAvailable(KvgateError):
    status = 503
    type_ = "ServiceUnavailableError"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message, retry_after=retry_after)
