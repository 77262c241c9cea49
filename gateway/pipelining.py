"""A refusal's place among pipelined answers (`gateway.httpguard`): a refused request head
read behind requests still to be answered (a miscounted ``Content-Length`` leaves bytes that
are no request; a pipelined ``HTTP/2.0`` line or oversized head) waits for their answers and
goes out after the last, then the connection closes (lingering: `_linger`); a pipelined
request's body timer starts at its turn, when the answer before it is complete.

A connection that closes after its answer (the client said ``Connection: close``, an
HTTP/1.0 client, an ``Expect: 100-continue`` answered before its body) while the request's
body is still arriving (a 413 for a ``Content-Length`` past the limit, a 401 before the body
is read) closes lingering too: uvicorn closed it at once, and the client, still writing its
body, was answered with a reset (ECONNRESET on its writes; a client that has not read the
answer yet by then may lose it). A keep-alive connection is not closed when at most
`DRAIN_MAX_BYTES` of the body are still due when its answer starts: they are read and dropped
and the connection serves the next request. More than that (a ``Content-Length`` of 1 GiB
answered 413, a 401 before a large upload) or a chunked body not yet ended (its size
unknown) is not read to keep a connection: the answer says ``Connection: close`` and the
connection closes lingering. (It was drained whole, up to `body_timeout_s`, 60 s.)

A lingering close is bounded: at most `LINGER_MAX_S` and `LINGER_MAX_BYTES` are read and
dropped (a client refused before its body that trickles it a byte at a time held its
connection 30 s), then it closes; a client still writing past them may be reset."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.read_timeouts import ReadTimeouts

__all__ = ["DRAIN_MAX_BYTES", "LINGER_MAX_BYTES", "LINGER_MAX_S", "LINGER_S",
           "PipelinedAnswers"]

LINGER_S = 1.0  # a closing connection is read (and dropped) until it is quiet this long
LINGER_MAX_S = 2.0  # ... or for this long at most
LINGER_MAX_BYTES = 16 * 1024 * 1024  # ... or until this much was dropped
# at most this much of a body still due when its answer starts is read (and dropped) to keep
# a keep-alive connection for the next request; more, and the answer closes it
DRAIN_MAX_BYTES = 1024 * 1024


class _BodyDue:
    """A request's `cycle.transport` while its body is still arriving: what uvicorn writes
    goes straight to the connection; its close after an answer that came first is a
    lingering one (`PipelinedAnswers._linger`)."""

    __slots__ = ("close", "get_extra_info", "is_closing", "write")

    def __init__(self, transport: asyncio.Transport, linger: Any) -> None:
        self.write = transport.write
        self.is_closing = transport.is_closing
        self.get_extra_info = transport.get_extra_info
        self.close = linger


class PipelinedAnswers(ReadTimeouts):
    """Writes a refusal in its turn, times a pipelined body from its own and lingers after an
    answer that closes its connection before its body ended (module docstring)."""

    _last_read = 0.0  # when the lingering connection last read (and dropped) bytes
    _linger_end = 0.0
    _body_due: Any = None  # a request closing after its answer, while its body arrives
    _lingering = False  # our side closed, the client's bytes dropped until `_lingered`
    _dropped_bytes = 0
    # a keep-alive request told to close if answered while more than `DRAIN_MAX_BYTES` of its
    # body are due, and how many are (None: chunked, unknown until its last chunk)
    _reopen: Any = None
    _unread: int | None = None

    def _answer_and_close(self, answer: bytes) -> None:
        """Write a refusal, then close (lingering). A refusal of a request head read behind
        requests still to be answered (pipelined: a miscounted `Content-Length` leaves bytes
        that are no request) waits for their answers: written at once, it cut them off (the
        client got the 400 alone, its valid request ran upstream for nothing, a 499)."""
        self._disarm()
        self._refused = True
        if self._in_headers and self._answers_due():
            self._deferred = answer  # written by `on_response_complete` once they are
            return
        self.transport.write(answer)
        self._linger()

    def _linger(self) -> None:
        """A lingering close: our side half-closed after the answer, what the client still
        sends read and dropped (`data_received`) until it is quiet for `LINGER_S` (at most
        `LINGER_MAX_S`), so a client still sending gets the answer instead of a reset."""
        self._disarm()
        self._refused = True  # what comes now is dropped
        transport = self.transport
        if transport.is_closing():
            return
        if not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        self.flow.resume_reading()  # (paused while a body waited for the app to read it)
        self._last_read = now = self.loop.time()
        self._linger_end = now + LINGER_MAX_S
        self._lingering = True
        self._timer = self.loop.call_later(LINGER_S, self._lingered)

    def _dropped(self, size: int) -> None:
        """A read of a refused connection, dropped: once lingering, at most
        `LINGER_MAX_BYTES` are read before it closes."""
        self._last_read = self.loop.time()
        self._dropped_bytes += size
        if self._lingering and self._dropped_bytes > LINGER_MAX_BYTES:
            self._disarm()
            self.transport.close()

    def _lingered(self) -> None:
        now = self.loop.time()
        quiet_at = self._last_read + LINGER_S
        if now >= min(quiet_at, self._linger_end) or self.transport.is_closing():
            self._timer = None
            self.transport.close()
            return
        self._timer = self.loop.call_later(min(quiet_at, self._linger_end) - now,
                                           self._lingered)

    def _answers_due(self) -> bool:
        running = self._running
        return bool(self.pipeline) or (running is not None and not running.response_complete)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return
        if cycle.keep_alive and (self._codings is not None or (
                self._length is not None and self._length > DRAIN_MAX_BYTES)):
            # answered before its body ends, it closes the connection (uvicorn writes
            # `connection: close`); kept alive again once at most DRAIN_MAX_BYTES are due
            cycle.keep_alive = False
            self._reopen = cycle
            self._unread = self._length if self._codings is None else None
        if not cycle.keep_alive or cycle.waiting_for_100_continue:
            # closed after its answer: a lingering close while its body is due
            self._body_due = cycle
            cycle.transport = _BodyDue(self.transport, self._close_after_answer)  # type: ignore[assignment]

    def on_body(self, body: bytes) -> None:
        if self._unread is not None:
            self._unread -= len(body)
            if self._unread <= DRAIN_MAX_BYTES:
                self._keep_alive_again()
        super().on_body(body)

    def _keep_alive_again(self) -> None:
        """The body of a request told to close (`on_headers_complete`) is in, or so nearly
        that the rest is drained if it is answered now: its connection is kept alive."""
        cycle, self._reopen, self._unread = self._reopen, None, None
        if cycle is not None and not cycle.response_started:
            cycle.keep_alive = True

    def shutdown(self) -> None:
        self._reopen = self._unread = None  # uvicorn's graceful shutdown: closed after it
        super().shutdown()

    def on_message_complete(self) -> None:
        self._keep_alive_again()
        cycle = self._body_due
        if cycle is not None:
            self._body_due = None
            if isinstance(cycle.transport, _BodyDue):
                cycle.transport = self.transport
        super().on_message_complete()

    def _close_after_answer(self) -> None:
        """uvicorn's close of a connection whose request's body was still due."""
        due = self._body_due
        if due is not None and due.more_body and not due.disconnected:
            self._body_due = None
            if self.timeout_keep_alive_task is not None:
                self.timeout_keep_alive_task.cancel()
            self._linger()
        else:
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._refused and self._deferred is None and self.timeout_keep_alive_task:
            self.timeout_keep_alive_task.cancel()  # lingering: closed by `_lingered`
            self.timeout_keep_alive_task = None
        cycle = self.cycle
        if cycle is not None and cycle is self._running and cycle.more_body and not (
                cycle.response_complete or self._refused):
            self._arm(self.limits.body_timeout_s, self._body_timeout)  # a pipelined one's turn
        answer = self._deferred
        if answer is None or self._answers_due() or self.transport.is_closing():
            return
        self._deferred = None
        if self.timeout_keep_alive_task is not None:  # armed by uvicorn: closing now anyway
            self.timeout_keep_alive_task.cancel()
        self._answer_and_close(answer)
