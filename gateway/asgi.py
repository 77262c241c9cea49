"""ASGI type aliases shared by the gateway's plain-ASGI routes, and how they send a whole
answer."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["ASGIApp", "Headers", "Message", "Receive", "Scope", "Send", "send_whole"]

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]


async def send_whole(send: Send, status: int, headers: Headers, body: bytes) -> None:
    """A whole answer: its length, not chunked framing (which an HTTP/1.0 client cannot
    read)."""
    headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
