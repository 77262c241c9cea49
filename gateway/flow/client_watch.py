"""A queued request's client: whether it left while its request waited in flow control's
queue (`FlowGate._wait`), at the HTTP edge (`ClientWatch`) or wherever a ``gone`` callable
says so."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.halfclose import EOF_PROBE, REPROBE_S

__all__ = ["ClientGone", "ClientWatch", "client_left", "until_disconnect"]


class ClientGone(Exception):
    """The queued request's client disconnected."""


async def until_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    """Returns when the ASGI client disconnects (the body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientWatch:
    """A queued request's client at the HTTP edge: called, returns when it has left
    (`until_disconnect`); `probing`: the answer to come of the probe of a FIN it sent, while
    it is not known whether it left or only half-closed its side (`gateway.halfclose`)."""

    __slots__ = ("_receive", "_scope")

    def __init__(self, receive: Callable[[], Awaitable[Any]], scope: Mapping[str, Any]) -> None:
        self._receive, self._scope = receive, scope

    async def __call__(self) -> None:
        await until_disconnect(self._receive)

    def probing(self) -> asyncio.Future[bool] | None:
        probe: asyncio.Future[bool] | None = self._scope.get("extensions", {}).get(EOF_PROBE)
        return probe if probe is not None and not probe.done() else None


async def client_left(gone: Callable[[], Awaitable[object]], watch: asyncio.Future[object]) -> bool:
    """Whether the client of a request just released from the queue has left: its watch saw
    it go (the queue's removal of it had not run yet), or it sent a FIN whose probe says so
    (waited for: a slot that freed as it left would otherwise send it to a replica)."""
    probe = gone.probing() if isinstance(gone, ClientWatch) else None
    if probe is not None and not watch.done():
        await asyncio.wait((probe, watch), timeout=REPROBE_S,
                           return_when=asyncio.FIRST_COMPLETED)
    if watch.done() and not watch.cancelled():
        return True
    return probe is not None and probe.done() and probe.result() is False

