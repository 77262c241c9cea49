"""Errors raised by tenancy and the admin API, each knowing its HTTP status and OpenAI shape.

They are part of the gateway's one hierarchy (`gateway.errors.KvgateError`), so the proxy
renders them with every other error it raises, and the admin router with `to_dict`: both give
``{"error": {"message","type","param","code"}}``. Messages never contain keys, salts, the
server secret or prompt text.
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
    type: str = "invalid_request_error"
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
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(TenancyError):
    code = "invalid_request"


class AuthError(TenancyError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(TenancyError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(TenancyError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class Conflict(TenancyError):
    status = 409
    type = "conflict_error"
    code = "conflict"


class PreconditionFailed(TenancyError):
    status = 412
    type = "precondition_failed"
    code = "version_mismatch"


class RateLimited(TenancyError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, retry_after=max(1, math.ceil(retry_after_s)))
        self.retry_after_s = retry_after_s


class BackendUnavailable(TenancyError):
    """The shared store (Redis) cannot be reached, or cached state is too stale to trust."""

    status = 503
    type = "service_unavailable"
    code = "store_unavailable"
