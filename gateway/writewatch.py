"""A client that keeps its connection open but does not read an answer already written to it.

uvicorn hands a whole (non-streamed) answer to the transport in one write and the request is
over; what the socket cannot take waits in the transport's write buffer, and uvicorn has no
write timeout: a client that stops reading kept that buffer (a 20 MB answer: 20 MB) for as long
as it kept its socket open -- ten such clients took a gateway from 75 MB to 313 MB, none of it
counted anywhere (its request already finished). Closing the connection does not free it
either: asyncio's `close` waits for the buffer to drain.

So once an answer is written in full (a stream's last bytes too) with bytes still buffered, the
buffer is looked at every `write_timeout_s` (`upstream.idle_timeout_s`, what a stream's client
gets to take a chunk, `gateway.timeouts`): smaller than at the last look, the client reads and
is left alone however slow; not smaller, the connection is reset (its buffer dropped), logged
and counted (`kvgate_unread_answers_total`). A client that stopped reading is reset between one
and two periods after its last byte taken, one that never read one period after its answer.
An answer still being written is the app's to judge (a stream's send waits for the client,
and its stall rule ends it), so a look during one only notes the size. Normal traffic pays one
`get_write_buffer_size()` per answer: a timer only while bytes are buffered at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["WriteWatch"]


class WriteWatch(HttpToolsProtocol):
    """The write watchdog of `gateway.httpguard.GuardedHttpTools` (module docstring)."""

    write_timeout_s = 120.0  # the instance's own from `HttpLimits`
    _watch: asyncio.TimerHandle | None = None
    _buffered = 0  # the write buffer's size at the last look

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        size = self.transport.get_write_buffer_size()
        if size:  # the client has not taken all of it yet: watched from now
            self._look_later(size)

    def _look_later(self, size: int) -> None:
        self._buffered = size
        if self._watch is not None:
            self._watch.cancel()
        self._watch = self.loop.call_later(self.write_timeout_s, self._look)

    def _look(self) -> None:
        self._watch = None
        size = self.transport.get_write_buffer_size()
        if not size:
            return
        cycle = self.cycle  # the newest request: a pipelined answer runs last
        writing = cycle is not None and cycle.response_started and not cycle.response_complete
        if size < self._buffered or writing:
            self._look_later(size)
            return
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # a request read after it, not answered yet: gone
            cycle.message_event.set()
        _reset(self.transport)
        self.logger.info("client stopped reading its answer: connection reset "
                         "(%d bytes unread)", size)
        count: Callable[[], None] | None = getattr(self.config.app, "unread_answer", None)
        if count is not None:
            count()


_LINGER_0 = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() discards and sends a RST


def _reset(transport: asyncio.Transport) -> None:
    """Close with a reset: the socket's own unsent bytes (megabytes: the kernel grows a
    loopback send buffer to `tcp_wmem`'s max) are dropped with the transport's, and the client
    sees ECONNRESET, not a FIN after whatever the socket still held (`abort` alone)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
    transport.abort()
