"""Minimal raw-ASGI helpers (the simulator skips a framework to stay off the hot path)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

__all__ = ["ClientGone", "Receive", "Scope", "Send", "read_body", "send_json", "wait_disconnect"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = (b"content-type", b"application/json")


class ClientGone(Exception):
    """The client disconnected before we read its request."""


async def read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_json(send: Send, status: int, obj: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_bytes(send, status, orjson.dumps(obj), _JSON, headers)


async def send_bytes(send: Send, status: int, body: bytes, content_type: tuple[bytes, bytes],
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    head = [content_type, (b"content-length", str(len(body)).encode())]
    if headers:
        head.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
