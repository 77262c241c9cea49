"""What the HTTP guard (`gateway.httpguard`) shares with the rest of the gateway: its limits
(`HttpLimits`, from `server.*`) and the scope extensions it puts into a request, with their
readers (`refused_status`, `abort_client`) for the app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ABORT", "REFUSED", "HttpLimits", "abort_client", "refused_status"]

ABORT = "kvgate.abort"  # the scope extension holding a request's abort callable
REFUSED = "kvgate.refused"  # the scope extension: the status the guard answered it with


def refused_status(scope: dict[str, Any]) -> int | None:
    """The status the guard answered a request with itself while its body was due (408: too
    slow; 400: cut short): what the client got, for the app's count of a request it then sees
    gone (a 499 otherwise)."""
    status: int | None = scope.get("extensions", {}).get(REFUSED)
    return status


def abort_client(scope: dict[str, Any]) -> None:
    """Reset the connection of a client that stopped reading its stream: nothing more can be
    sent, and the unfinished answer is a client gone, not an app error, to the server."""
    abort = scope.get("extensions", {}).get(ABORT)
    if abort is not None:
        abort()


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 120.0  # an answer's buffered bytes unread this long (`writewatch`)
