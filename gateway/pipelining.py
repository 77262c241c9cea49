"""A refusal's place among pipelined answers (`gateway.httpguard`): a refused request head
read behind requests still to be answered (a miscounted ``Content-Length`` leaves bytes that
are no request; a pipelined ``HTTP/2.0`` line or oversized head) waits for their answers and
goes out after the last, then the connection closes (lingering: `LINGER_S`); a pipelined
request's body timer starts at its turn, when the answer before it is complete."""

from __future__ import annotations

from gateway.read_timeouts import ReadTimeouts

__all__ = ["LINGER_S", "PipelinedAnswers"]

LINGER_S = 2.0  # a refused connection is read (and dropped) this long before it is closed


class PipelinedAnswers(ReadTimeouts):
    """Writes a refusal in its turn and times a pipelined body from its own (module
    docstring)."""

    def _answer_and_close(self, answer: bytes) -> None:
        """Write a refusal, then close: a lingering close (our side half-closed, what the
        client still sends read and dropped, for at most `LINGER_S`), so a client still
        sending gets the answer instead of a reset. A refusal of a request head read behind
        requests still to be answered (pipelined: a miscounted `Content-Length` leaves bytes
        that are no request) waits for their answers: written at once, it cut them off (the
        client got the 400 alone, its valid request ran upstream for nothing, a 499)."""
        self._disarm()
        self._refused = True
        if self._in_headers and self._answers_due():
            self._deferred = answer  # written by `on_response_complete` once they are
            return
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _answers_due(self) -> bool:
        running = self._running
        return bool(self.pipeline) or (running is not None and not running.response_complete)

    def on_response_complete(self) -> None:
        super().on_response_complete()
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
