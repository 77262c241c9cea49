"""One keep-alive HTTP/1.1 connection to a replica (`gateway.h1`'s pool holds them): writes a
request, parses the answer with httptools and hands its body out as it comes.

Rules it keeps:
- reading pauses while `HIGH_WATER` bytes wait for a slow client and resumes once they are
  taken, so a stream never buffers without bound;
- an answer's head (status line and headers) longer than `MAX_HEAD_BYTES` fails the exchange;
  so does one with a `Content-Encoding` (every request asks for identity: a proxy that
  compresses anyway sent bytes kvgate can neither read nor relay as the JSON they claim to be),
  or a status HTTP has no answer of (101, under 100, 600 and above); an interim answer (100,
  102, 103) is skipped for the answer after it;
- an answer's media type (`Content-Type` before its parameters) is read in lower case, as it
  is compared (`Text/Event-Stream` is a stream); its end-to-end headers are kept for the
  client (`passed`: `gateway.answer_headers`);
- bytes that start another answer after a whole one (to no request: a replica or a proxy
  gone wrong) fail the connection: they are neither relayed as part of that answer nor taken
  for the next request's on a reused connection;
- an answer delimited by the end of its connection (no length, not chunked) ends at a clean
  close; a reset cuts it short, as any other answer;
- failures raise `ConnectionError`s (`UpstreamClosed`, `UpstreamProtocolError`), which
  `gateway.transport.TRANSPORT_ERRORS` covers.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from typing import cast

import httptools

from gateway.answer_headers import passes, without_listed
from gateway.upstream_errors import encoded

__all__ = ["H1Conn", "UpstreamClosed", "UpstreamProtocolError"]

HIGH_WATER = 256 * 1024  # bytes of an answer buffered for a slow reader before reading pauses
# an answer whose status line and headers go on past this is not HTTP a replica sends: the
# parser joins a header's pieces as they come (quadratic: a 25 MB header held the event loop
# for half a minute)
MAX_HEAD_BYTES = 64 * 1024


class UpstreamClosed(ConnectionResetError):
    """The replica closed the connection before the answer was complete."""


class UpstreamProtocolError(ConnectionError):
    """The replica's answer is not valid HTTP/1.1."""


class H1Conn(asyncio.Protocol):
    """One connection to a replica; carries one exchange at a time."""

    def __init__(self, key: tuple[str, int, bool]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._loop = asyncio.get_running_loop()
        self._reset()

    def _reset(self) -> None:
        self._new_head()
        self.head: asyncio.Future[None] = self._loop.create_future()
        self.any_byte = False  # of this exchange's answer
        self._head_bytes = 0  # received before the answer's head was complete
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    def _new_head(self) -> None:
        """What an answer's head sets (again after an interim answer's)."""
        self.status = 0
        self.content_type = "application/json"
        self.content_length: str | None = None
        self.retry_after: str | None = None
        self._encoding: bytes | None = None
        self._chunked = False
        self._interim = False
        self.passed: list[tuple[bytes, bytes]] = []  # end-to-end: `gateway.answer_headers`
        self._connection = b""

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.any_byte = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("the replica switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamProtocolError(f"invalid HTTP answer: {exc}"))
        if not self.head.done():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._fail(UpstreamProtocolError("the answer's head is too large"))

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete or self.error is not None:
            return
        if exc is None and self.head.done() and self.content_length is None \
                and not self._chunked:
            # a body delimited by the end of the connection: a close (FIN) ends it, a reset
            # (`exc`) cuts it, as it cuts any other answer
            self.complete = True
            self.keep_alive = False
            self._wake()
            return
        self._fail(UpstreamClosed("the replica closed the connection"))

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # (raised out of `feed_data`: the exchange fails, `data_received`)
            raise UpstreamProtocolError("an answer after the whole answer, to no request")

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        if lname == b"content-type":
            # media types are case-insensitive (RFC 9110 8.3.1): kept in lower case, as compared
            media, sep, params = value.partition(b";")
            self.content_type = (media.lower() + sep + params).decode("latin-1")
        elif lname == b"content-length":
            self.content_length = value.decode("latin-1")
        elif lname == b"retry-after":
            self.retry_after = value.decode("latin-1")
        elif lname == b"transfer-encoding" and b"chunked" in value.lower():
            self._chunked = True
        elif lname == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            self._encoding = value[:32]
        elif lname == b"connection":  # (each of its fields: a list of names)
            self._connection = b"%s,%s" % (self._connection, value)
        elif passes(lname):
            self.passed.append((lname, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # an interim answer (100 Continue, 103 Early Hints from a proxy): the answer follows
            self._new_head()
            self._interim = True
            return
        self.status = status
        if self._connection and self.passed:  # (the names it lists are hop by hop too)
            self.passed = without_listed(self.passed, self._connection)
        if not 200 <= status < 600:  # no answer HTTP has (uvicorn raised sending it on)
            self._fail(UpstreamProtocolError(f"an answer of status {status}"))
        elif self._encoding is not None:
            self._fail(UpstreamProtocolError(encoded(self._encoding)))
        elif not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()

    # -- the exchange ----------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved: no "never retrieved" warning if nobody waits
        self._wake()
        self.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def start(self, request: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(request)

    def at_hand(self) -> bool:
        """Whether `read_chunk` returns without waiting: bytes came, or the body's end or a
        failure."""
        return bool(self._chunks) or self.complete or self.error is not None

    async def read_chunk(self) -> bytes:
        while not self._chunks:
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()
