"""The upstream transport seam: the only module that knows which HTTP clients kvgate uses.

Proxied requests (`post`; `open`: a stored response's GET, streamed or whole, or its cancel)
go through kvgate's own HTTP/1.1 client (`gateway.h1`: raw asyncio connections kept alive per
replica, httptools parsing): aiohttp's client cost about a quarter of kvgate's CPU per request
under load, and an answer read chunk by chunk is bounded as a proxied one
(`upstream.max_answer_bytes`). Health checks and model discovery (`get`) are rare and use
aiohttp.
(httpx was measured at ~800 us of client CPU per request for this pattern, aiohttp ~65-75 us;
see `loadtest/bench_overhead.py` for the proxy as a whole against a bare pass-through.)

The rest of the gateway sees only the `Transport` and `UpstreamResponse` protocols: `Pools`
takes a `TransportFactory` (`default_transport` by default), so a test or a future client swaps
in behind them. An in-process fake must raise what a failed exchange raises here
(`TRANSPORT_ERRORS`, `TimeoutError`).
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp

from gateway.h1 import H1Pool

__all__ = [
    "MAX_GET_BYTES", "TRANSPORT_ERRORS", "ReplicaTransport", "Transport", "TransportFactory",
    "UpstreamResponse", "connect_failure", "default_transport", "read_at_most", "refused",
]

# What a failed exchange raises: connect errors, resets, protocol errors, bad payloads.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, OSError)


# what `ReplicaTransport.get` reads of a body: vLLM's /health is empty and /v1/models a card
# per model (its LoRA adapters included); read whole, an endless /health grew the gateway by
# gigabytes within one probe's timeout
MAX_GET_BYTES = 1 << 20

UNREACHABLE = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})


def refused(exc: BaseException) -> bool:
    """Nothing could be connected to (refused, unreachable, no such host) -- as opposed to a
    slow connect or a reset of an open connection."""
    if isinstance(exc, TimeoutError):
        return False
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError | socket.gaierror):
        return True
    return isinstance(exc, OSError) and exc.errno in UNREACHABLE


def connect_failure(exc: BaseException, url: str) -> str:
    """Why nothing could be connected to at `url`, for logs and reasons: ``"cannot resolve
    host NAME"`` when its host name did not resolve (a typo, a Service not there yet), else
    ``"cannot connect"``."""
    if isinstance(getattr(exc, "os_error", exc), socket.gaierror):  # (aiohttp wraps it)
        return f"cannot resolve host {urlsplit(url).hostname}"
    return "cannot connect"


class UpstreamResponse(Protocol):
    """An upstream answer whose headers have arrived; the body is read chunk by chunk."""

    status: int
    content_type: str
    content_length: str | None
    retry_after: str | None  # the answer's Retry-After header, as sent
    passed: list[tuple[bytes, bytes]]  # its headers that reach the client (`answer_headers`)

    async def read_chunk(self) -> bytes:
        """The bytes that have arrived (waits for some); b"" at the end of the body."""
        ...

    def at_hand(self) -> bool:
        """Whether `read_chunk` returns without waiting (bytes arrived, the body ended or
        failed): a read then needs no timer."""
        ...

    async def read_all(self) -> bytes: ...

    def release(self) -> None:
        """Finished normally: the connection may be reused."""

    def abort(self) -> None:
        """Abandoned (client gone, timeout, error): close the connection so the replica
        sees the disconnect and aborts the generation."""


class Transport(Protocol):
    """A pooled client for one pool of replicas."""

    async def post(
        self, url: str, body: bytes, headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send; returns once the response headers arrived. `on_send` is called as the
        request goes out, once it has one of the replica's connections (it may wait for one:
        `upstream.max_connections`)."""
        ...

    async def get(self, url: str, timeout_s: float, headers: dict[str, str]) -> tuple[int, bytes]:
        """A small GET for health checks and model discovery."""
        ...

    async def open(
        self, url: str, headers: dict[str, str], method: str = "GET",
    ) -> UpstreamResponse:
        """A request without a body (a stored response's GET or cancel) whose answer is read
        as it arrives; returns once the response headers arrived."""
        ...

    @property
    def closed(self) -> bool: ...

    async def close(self) -> None: ...


# (max_connections per replica, connect_timeout_s) -> a transport; called on the event loop
TransportFactory = Callable[[int, float], Transport]


async def read_at_most(content: aiohttp.StreamReader, limit: int) -> bytes:
    """A body up to just past `limit` bytes: longer than `limit` when the body is (nothing more
    is read; leaving the response unread closes its connection)."""
    parts: list[bytes] = []
    size = 0
    async for chunk in content.iter_any():
        parts.append(chunk)
        size += len(chunk)
        if size > limit:
            break
    return b"".join(parts)


def default_transport(max_connections: int, connect_timeout_s: float) -> Transport:
    return ReplicaTransport(max_connections=max_connections,
                            connect_timeout_s=connect_timeout_s)


class ReplicaTransport:
    """`Transport` of one pool of replicas: `gateway.h1` for proxied requests, aiohttp for
    the rest."""

    def __init__(self, *, max_connections: int, connect_timeout_s: float) -> None:
        self._h1 = H1Pool(max_connections=max_connections, connect_timeout_s=connect_timeout_s)
        connector = aiohttp.TCPConnector(
            # per replica, as the proxied requests' (`upstream.max_connections`)
            limit=0, limit_per_host=max_connections, keepalive_timeout=30.0,
            enable_cleanup_closed=False, ttl_dns_cache=300,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # no read timeouts here: the proxy's watchdog owns first-byte / idle / total
            timeout=aiohttp.ClientTimeout(
                total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s
            ),
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,  # relay bytes as sent
            skip_auto_headers=("User-Agent",),
            trust_env=False,
            raise_for_status=False,
        )

    async def post(
        self, url: str, body: bytes, headers: dict[str, str],
        on_send: Callable[[], None] | None = None,
    ) -> UpstreamResponse:
        """Send; returns once the response headers arrived."""
        return await self._h1.post(url, body, headers, on_send)

    async def open(
        self, url: str, headers: dict[str, str], method: str = "GET",
    ) -> UpstreamResponse:
        """A request without a body, read as it arrives, on the proxied requests' client (the
        caller owns the timeouts, as for `post`)."""
        return await self._h1.send(method, url, b"", headers)

    async def get(self, url: str, timeout_s: float, headers: dict[str, str]) -> tuple[int, bytes]:
        """A small GET for health checks and model discovery: the status and at most
        `MAX_GET_BYTES` of the body (health reads the status; a model list cut short does
        not parse, and teaches nothing)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.get(url, timeout=timeout, headers=headers) as resp:
            return resp.status, (await read_at_most(resp.content, MAX_GET_BYTES))[:MAX_GET_BYTES]

    @property
    def closed(self) -> bool:
        return self._h1.closed and self._session.closed

    async def close(self) -> None:
        await self._h1.close()
        await self._session.close()
        # let the connector's transports finish closing before the loop goes away
        await asyncio.sleep(0)
