"""Errors raised by tenancy and the admin API, each knowing its HTTP status and OpenAI shape.

They are part of the gateway's one hierarchy (`gateway.errors.KvgateError`) and use its one
`type` vocabulary (vLLM's: ``AuthenticationError``, ``RateLimitError``, ...), so every error a
client sees from kvgate or from a replica through it reads the same. The body is
``{"error": {"message","type","param","code"}}``; `code` is a stable machine-readable string
(OpenAI's where one exists: ``invalid_api_key``, ``rate_limit_exceeded``). Messages never
contain keys, salts, the server secret or prompt text.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from gateway.errors import KvgateError

__all__ = [
    "AuthError",
    "BackendUnavailable",
    "Conflict",
    "InvalidRequest",
    "NotFound",
    "PermissionDenied",
    "PreconditionFailed",
    "RateLimited",
    "TenancyError",
]


class TenancyError(KvgateError):
    status: int = 400
    type_: str = "BadRequestError"
    code: str | None = None

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message, param=param, retry_after=retry_after)

    def body(self) -> bytes:
        return orjson.dumps(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type_,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(TenancyError):
    code = "invalid_request"


class AuthError(TenancyError):
    status = 401
    type_ = "AuthenticationError"
    code = "invalid_api_key"


class PermissionDenied(TenancyError):
    status = 403
    type_ = "PermissionDeniedError"
    code = "forbidden"


class NotFound(TenancyError):
    status = 404
    type_ = "NotFoundError"
    code = "not_found"


class Conflict(TenancyError):
    status = 409
    type_ = "ConflictError"
    code = "conflict"


class PreconditionFailed(TenancyError):
    status = 412
    type_ = "PreconditionFailedError"
    code = "version_mismatch"


class RateLimited(TenancyError):
    status = 429
    type_ = "RateLimitError"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, retry_after=max(1, math.ceil(retry_after_s)))
        self.retry_after_s = retry_after_s


class BackendUnavailable(TenancyError):
    """The shared store (Redis) cannot be reached, or cached state is too stale to trust."""

    status = 503
    type_ = "ServiceUnavailableError"
    code = "store_unavailable"
