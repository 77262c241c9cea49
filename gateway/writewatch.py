"""A client that keeps its connection open but does not read an answer already written to it.

uvicorn hands a whole (non-streamed) answer to the transport in one write and the request is
over; what the socket cannot take waits in the transport's write buffer, and uvicorn has no
write timeout: a client that stops reading kept that buffer (a 20 MB answer: 20 MB) for as long
as it kept its socket open -- ten such clients took a gateway from 75 MB to 313 MB, none of it
counted anywhere (its request already finished). Closing the connection does not free it
either: asyncio's `close` waits for the buffer to drain.

So once an answer is written in full (a stream's last bytes too) with bytes still buffered, what
the client has not taken -- the transport's buffer and the socket's own send queue (Linux's
SIOCOUTQ: a slow reader drains the socket steadily, but the transport's buffer only in steps
of part of the socket's send buffer, which grows to megabytes on loopback: a client reading
64 KB/s was cut at a 5 s period when only the transport's buffer was looked at) -- is looked at
`LOOKS` times per `write_timeout_s` (`upstream.idle_timeout_s`, what a stream's client gets to
take a chunk, `gateway.timeouts`). Less than at the look before, the client reads and is left
alone however slowly; no less at `LOOKS` looks in a row (a whole period), the connection is
reset (both buffers dropped), logged and counted (`kvgate_unread_answers_total`): 1 to 1.25
periods after the client last took a byte (its kernel takes a few more once the answer is
written, even unread). The watch ends when the transport's buffer is empty (what the socket
holds is the kernel's, bounded by its `tcp_wmem`). An answer still being written is the app's
to judge (a stream's send waits for the client, and its stall rule ends it), so a look during
one counts as progress. Normal traffic pays one `get_write_buffer_size()` per answer: a timer
only while bytes are buffered at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import socket
import struct
import termios
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["LOOKS", "WriteWatch", "reset"]

LOOKS = 4  # looks per `write_timeout_s` (module docstring)


class WriteWatch(HttpToolsProtocol):
    """The write watchdog of `gateway.httpguard.GuardedHttpTools` (module docstring)."""

    write_timeout_s = 120.0  # the instance's own from `HttpLimits`
    _watch: asyncio.TimerHandle | None = None
    _unsent = 0  # what the client had not taken at the last look (`_queued`)
    _still = 0  # looks in a row that found no less

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        size = self.transport.get_write_buffer_size()
        if size:  # the client has not taken all of it yet: watched from now
            self._still = 0
            self._look_later(size + _queued(self.transport))

    def _look_later(self, unsent: int) -> None:
        self._unsent = unsent
        if self._watch is not None:
            self._watch.cancel()
        self._watch = self.loop.call_later(self.write_timeout_s / LOOKS, self._look)

    def _look(self) -> None:
        self._watch = None
        size = self.transport.get_write_buffer_size()
        if not size:
            return
        cycle = self.cycle  # the newest request: a pipelined answer runs last
        writing = cycle is not None and cycle.response_started and not cycle.response_complete
        unsent = size + _queued(self.transport)
        self._still = 0 if unsent < self._unsent or writing else self._still + 1
        if self._still < LOOKS:
            self._look_later(unsent)
            return
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # a request read after it, not answered yet: gone
            cycle.message_event.set()
        reset(self.transport)
        self.logger.info("client stopped reading its answer: connection reset "
                         "(%d bytes unread)", size)
        count: Callable[[], None] | None = getattr(self.config.app, "unread_answer", None)
        if count is not None:
            count()


def _queued(transport: asyncio.Transport) -> int:
    """The bytes in the socket's send queue, not yet acknowledged by the client (SIOCOUTQ, the
    same request number as TIOCOUTQ on Linux); 0 where that cannot be asked."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return int(struct.unpack("i", out)[0])


_LINGER_0 = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() discards and sends a RST


def reset(transport: asyncio.Transport) -> None:
    """Close with a reset: the socket's own unsent bytes (megabytes: the kernel grows a
    loopback send buffer to `tcp_wmem`'s max) are dropped with the transport's, and the client
    sees ECONNRESET, not a FIN after whatever the socket still held (`abort` alone)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
    transport.abort()
