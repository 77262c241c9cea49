"""The simulator's errors, rendered in vLLM's current nested shape or the flat pre-0.10.1 one."""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["SimError", "dead_engine_error", "engine_faulted_error", "error_body", "sse_error"]

# vllm/entrypoints/serve/exception_handling/error_response.py: what an EngineDeadError becomes
DEAD_MESSAGE = "The server had an error while processing your request."
# No 0.34 source text was available for EngineFaultedError (the fault-tolerance pause of
# vllm/v1/engine, RFC #27866): the message is the simulator's own, the status (503) and the
# healthy /health are what the checked facts say.
FAULTED_MESSAGE = ("EngineFaultedError: the engine core reported a fault and is paused waiting "
                   "for recovery; it cannot accept new requests.")


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


def dead_engine_error() -> SimError:
    return SimError(500, DEAD_MESSAGE, "InternalServerError")


def engine_faulted_error() -> SimError:
    return SimError(503, FAULTED_MESSAGE, "ServiceUnavailableError")


def error_body(err: SimError, legacy: bool) -> dict[str, Any]:
    if legacy:  # vLLM < 0.10.1: {"object": "error", ...}
        return {"object": "error", "message": err.message, "type": err.type,
                "param": err.param, "code": err.status}
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.status}}


def sse_error(err: SimError, legacy: bool) -> bytes:
    """A mid-stream error event then the end marker (chat_completion/serving.py's handler)."""
    return b"data: " + orjson.dumps(error_body(err, legacy)) + b"\n\ndata: [DONE]\n\n"
