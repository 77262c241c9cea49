"""What every answer of the HTTP edge gets, under the guard's limits (`gateway.httpguard`):
TCP_NODELAY on the socket (small SSE writes must not wait for delayed ACKs), a ``Date`` header
(`date_header`), a close-delimited body for an HTTP/1.0 client (no chunked framing it cannot
read) and ``Connection: close`` after an ``Expect: 100-continue`` answered before its body."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from email.utils import formatdate
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

__all__ = ["NoDelayHttpTools", "date_header"]

Header = tuple[bytes, bytes]

_date: tuple[int, list[Header]] = (0, [])


def date_header() -> list[Header]:
    """``[(b"date", <IMF-fixdate of now>)]``, the same list object within a second (uvicorn
    copies its default headers into each answer; nothing mutates it)."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, [(b"date", formatdate(now, usegmt=True).encode())])
    return _date[1]


class NoDelayHttpTools(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # OSError: not a TCP socket (e.g. a unix socket)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None:  # every answer gets a Date (uvicorn's `date_header` is off)
            extra = cycle.default_headers
            cycle.default_headers = [*date_header(), *extra] if extra else date_header()
            if cycle.scope.get("http_version") == "1.0":
                _close_delimited(cycle)
                # RFC 9110 10.1.1 and 15.2: an HTTP/1.0 request's 100-continue is ignored (no
                # 1xx may go to an HTTP/1.0 client; uvicorn sent one at the first read)
                cycle.waiting_for_100_continue = False
            if cycle.waiting_for_100_continue:
                _close_if_unasked(cycle)


def _close_if_unasked(cycle: RequestResponseCycle) -> None:
    """A request with ``Expect: 100-continue`` answered before its body was asked for (401,
    413, 429, ...): the client holds the body back, and whether it will send it after a final
    answer is its choice, so the connection cannot carry a next request -- kept open, a next
    request's bytes would be read as this body's and never answered. The answer says
    ``Connection: close`` and the connection closes after it (RFC 9110 10.1.1: a server
    answering before the content says whether it keeps reading)."""
    send = cycle.send

    async def send_then_close(message: Any) -> None:
        # (`more_body` false: no body, or all of it came without waiting: nothing held back)
        if (message["type"] == "http.response.start" and cycle.waiting_for_100_continue
                and cycle.more_body):
            cycle.keep_alive = False  # uvicorn then writes `connection: close` and closes
        await send(message)

    cycle.send = send_then_close  # type: ignore[method-assign]


# more than any body: the close-delimited answer's bytes are not counted (`_close_delimited`)
_UNCOUNTED = 1 << 62


def _close_delimited(cycle: RequestResponseCycle) -> None:
    """An HTTP/1.0 client cannot read chunked framing (RFC 9112 6.1: a server must not send
    Transfer-Encoding to one), which uvicorn uses for any answer without a Content-Length (a
    stream): for such a request an answer without one is delimited by closing the
    connection instead (uvicorn closes it after an HTTP/1.0 answer anyway). The cycle's
    `send` is replaced before the app is run (`run_asgi` reads it when the task starts)."""
    send = cycle.send

    async def send_close_delimited(message: Any) -> None:
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", ())}
            if b"content-length" not in names and b"transfer-encoding" not in names:
                cycle.chunked_encoding = False  # uvicorn then writes the body as it comes
                cycle.expected_content_length = _UNCOUNTED
        elif (cycle.expected_content_length >= _UNCOUNTED // 2
              and not message.get("more_body", False)):
            cycle.expected_content_length = len(message.get("body", b""))  # its last part
        await send(message)

    cycle.send = send_close_delimited  # type: ignore[method-assign]

