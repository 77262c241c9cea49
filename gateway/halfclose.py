"""A client that half-closes its side after a whole HTTP/1.1 request, told apart from one that
left (`gateway.httpguard`'s module docstring says what the client sees).

``shutdown(SHUT_WR)`` ends the request, not the connection, but uvicorn took the EOF for a
disconnect and the app cancelled the request. The FIN looks the same as a client that closed
its socket (an SDK's timeout), whose request must not run on, so the connection is kept open
and probed with an interim ``100 Continue`` (RFC 9110 15.2: a client must parse an
unexpected 1xx) at once and every `REPROBE_S` until the last answer starts: a client gone
resets it (its kernel answers the probe with a RST), read as ``SO_ERROR`` `PROBE_S` later.
Pipelined requests sent before the FIN are answered in turn; no 100 goes out while one of
their answers is being written.

Once the last answer has started, no 1xx may go out: its own writes probe the client. A stream
that goes quiet (a replica that stalls, a long pause between events) writes nothing, and a
client that left meanwhile went unseen until the idle timeout (120 s by default) while its
request held a replica slot. So after `REPROBE_S` without a write, at an event boundary, the
stream gets an SSE comment line (`KEEP_ALIVE`, what vLLM's ``--sse-keep-alive-interval``
sends; clients skip comments) that probes as the 100 does.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gateway.writewatch import reset

__all__ = ["CONTINUE", "EOF_PROBE", "KEEP_ALIVE", "PROBE_S", "REPROBE_S", "HalfCloseProbe"]

# a half-closed client's probe (`HalfCloseProbe.eof_received`): the reset of a client gone
# is back within a round trip; a later one is seen at the next probe's write
PROBE_S = 0.2
REPROBE_S = 1.0
# the scope extension of a request whose client sent a FIN before its answer started: a
# future of the first probe's answer (True: a half-close, the client is there; False: gone).
# Flow control holds a request it releases meanwhile until it is known (`gateway.flow`)
EOF_PROBE = "kvgate.eof_probe"
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
KEEP_ALIVE = b"e\r\n: keep-alive\n\n\r\n"  # one chunk: an SSE comment line and its blank line
# a chunk whose data ends a whole SSE event, whatever its line ends (LF, CRLF, CR: kvgate
# relays a replica's as sent), then the chunk's own CRLF
_EVENT_END = (b"\n\n\r\n", b"\n\r\n\r\n", b"\r\r\r\n", b"\n\r\r\n", b"\r\r\n\r\n")


class _Tail:
    """The transport as a half-closed client's answer writes to it (`HalfCloseProbe`): whether
    the answer is an SSE stream, whether its last write ended an event, and when it was."""

    __slots__ = ("_clock", "_transport", "at", "boundary", "sse")

    def __init__(self, transport: asyncio.Transport, clock: Callable[[], float]) -> None:
        self._transport = transport
        self._clock = clock
        self.sse: bool | None = None  # known once the head is written
        self.boundary = False
        self.at = clock()

    def write(self, data: bytes) -> None:
        self._transport.write(data)
        if self.sse is None:  # uvicorn writes the status line and headers in one write
            head = data[:data.find(b"\r\n\r\n")].lower()
            self.sse = b"\r\ncontent-type: text/event-stream" in head
        # a chunk of uvicorn's chunked framing whose data ends a whole event
        self.boundary = data.endswith(_EVENT_END)
        self.at = self._clock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HalfCloseProbe(HttpToolsProtocol):
    """The half-close handling of `gateway.httpguard.GuardedHttpTools`."""

    _refused = False  # the guard refused the request (its own answer, then a close)
    _running: RequestResponseCycle | None = None  # the request whose answer is due next

    def connection_lost(self, exc: Exception | None) -> None:
        running = self._running  # uvicorn marks only the last request read (`self.cycle`)
        if running is not None and running is not self.cycle and not running.response_complete:
            running.disconnected = True  # a pipelined one behind it never ran: this one runs
            running.message_event.set()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio's signature
        """The client shut its sending side. After a whole HTTP/1.1 request that may be all
        it meant (a half-close): the connection stays open for the answer, probed for a
        client that left instead (module docstring). True keeps the transport open. With
        pipelined requests, `self.cycle` is the last one read; they are answered in turn."""
        cycle = self.cycle
        if (cycle is None or cycle.more_body or cycle.response_started or self._refused
                or self._answering() or cycle.scope.get("http_version") != "1.1"):
            # nothing asked, a request cut short, an answer under way (a stream read in part:
            # no 1xx can probe it now, and a quiet one writes nothing that would fail), or
            # HTTP/1.0: the client left
            return None
        cycle.keep_alive = False  # no request can come after it: closed once answered
        cycle.transport = cast(asyncio.Transport, _Tail(self.transport, self.loop.time))
        extensions = cast(dict[str, Any], cycle.scope).setdefault("extensions", {})
        extensions[EOF_PROBE] = self.loop.create_future()
        self._probe(cycle)
        return True

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        self._running = cycle  # the request being answered (pipelined ones wait behind it)
        super()._start_asgi_task(cycle, app)

    def _answering(self) -> bool:
        """An answer is under way (its head sent, not its end): no 100 may go out now."""
        running = self._running
        return running is not None and running.response_started and not running.response_complete

    def _probe(self, cycle: RequestResponseCycle) -> None:
        if cycle.response_complete or cycle.disconnected or self.transport.is_closing():
            return
        if cycle.response_started:
            self._probe_stream(cycle)
            return
        if self._answering():  # an earlier pipelined answer: its writes probe; look again
            self.loop.call_later(REPROBE_S, self._probe, cycle)
            return
        self.transport.write(CONTINUE)
        self.loop.call_later(PROBE_S, self._probed, cycle)

    def _probe_stream(self, cycle: RequestResponseCycle) -> None:
        """The last answer runs: its writes probe the client. A stream quiet for `REPROBE_S`
        at an event boundary is probed with a comment line (module docstring); one the
        client is not reading (bytes still buffered) is left to the stall rule."""
        tail = cycle.transport
        if (isinstance(tail, _Tail) and tail.sse and tail.boundary and cycle.chunked_encoding
                and self._running is cycle and self.loop.time() - tail.at >= REPROBE_S
                and not self.transport.get_write_buffer_size()):
            self.transport.write(KEEP_ALIVE)
            self.loop.call_later(PROBE_S, self._probed, cycle)
            return
        self.loop.call_later(REPROBE_S, self._probe, cycle)

    def _probed(self, cycle: RequestResponseCycle) -> None:
        if cycle.response_complete or cycle.disconnected or self.transport.is_closing():
            _answer_probe(cycle, False)
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            # reset: the client had closed its socket, not half of it. The request being
            # answered is the one to stop (uvicorn marks only the last one read gone)
            running = self._running
            self._abort(running if running is not None and not running.response_complete
                        else cycle)
            _answer_probe(cycle, False)
            return
        _answer_probe(cycle, True)
        self.loop.call_later(REPROBE_S - PROBE_S, self._probe, cycle)

    def _abort(self, cycle: RequestResponseCycle) -> None:
        """Reset the connection under `cycle`, an unfinished response the app gives up on.
        The cycle is marked disconnected now (the transport reports its loss only on the
        loop's next turn), so uvicorn takes the app's return as a client gone. A reset, not
        `abort` alone: that closes with a FIN after what the socket still holds (megabytes),
        and a stalled stream's client would read on to a normal close."""
        cycle.disconnected = True
        cycle.message_event.set()
        reset(self.transport)


def _answer_probe(cycle: RequestResponseCycle, there: bool) -> None:
    """The first probe's answer, to whoever waits for it (`EOF_PROBE`)."""
    probe = cast(dict[str, Any], cycle.scope).get("extensions", {}).get(EOF_PROBE)
    if probe is not None and not probe.done():
        probe.set_result(there)
