"""The simulator's errors, rendered in vLLM's current nested shape or the flat pre-0.10.1 one."""

from __future__ import annotations

from typing import Any

__all__ = ["SimError", "error_body"]


class SimError(Exception):
    """An error answered as JSON with an HTTP status (one class, mapped once in the app)."""

    def __init__(
        self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param


def error_body(err: SimError, legacy: bool) -> dict[str, Any]:
    if legacy:  # vLLM < 0.10.1: {"object": "error", ...}
        return {"object": "error", "message": err.message, "type": err.type,
                "param": err.param, "code": err.status}
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.status}}
