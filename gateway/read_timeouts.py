"""The HTTP guard's read timeouts (`gateway.httpguard`): a request's head not complete
`header_timeout_s` after its first byte (or after the connection opened: a slowloris, a
silent opener) and its body not complete `body_timeout_s` after its head are answered 408
and closed; an idle keep-alive connection is closed without one. A pipelined request's body
is timed from its turn (`gateway.pipelining`): until then uvicorn does not read it."""

from __future__ import annotations

from gateway.head_checks import HeadChecks

__all__ = ["ReadTimeouts"]


class ReadTimeouts(HeadChecks):
    """The one timer of a guarded connection (module docstring)."""

    def _arm(self, delay: float, callback: object) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, callback)  # type: ignore[arg-type]

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        if self._in_headers and not self.transport.is_closing():
            if self._header_bytes or self._begun or self.cycle is None:
                self._refuse(408, "The request headers did not arrive in time.")
            else:
                self.transport.close()  # an idle keep-alive connection: nothing was asked

    def _body_timeout(self) -> None:
        self._timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        running = self._running
        if running is not None and running is not cycle and not running.response_complete:
            # pipelined behind an answer still due: uvicorn stopped reading, so its body cannot
            # arrive; timed again when its turn comes (`on_response_complete`). The 408 went
            # out in the middle of the earlier answer (a stream cut, its chunks corrupted)
            return
        started = cycle.response_started
        cycle.disconnected = True  # the app's receive() now answers http.disconnect
        cycle.message_event.set()
        if started:
            self.transport.close()
        else:
            self._refuse(408, "The request body did not arrive in time.")
