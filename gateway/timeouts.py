"""Cancelling a proxied request when its client leaves or its replica is too slow.

One `Canceller` per request holds a single timer and a task that waits for the ASGI
``http.disconnect``. Either cancels the handler task and records why; the handler turns that
into a 504, an SSE error event, or nothing (client gone). Phases: until the answer has started
the first-byte timeout applies to a stream (its first SSE event -- vLLM sends a stream's
headers at once and ``: keep-alive`` comments while a request waits, and a Responses API
stream's ``response.created``/``response.in_progress`` events before its prefill: none is an
answer); a
non-streamed answer comes whole, after the last token (vLLM sends nothing before), so only the
total timeout bounds its wait: a first-byte deadline would cut (and the SDK retry, twice) every
legitimate generation longer than it. From then on the idle timeout between chunks. The timer
is lazy: a streamed chunk only stores the time (`touch`); the callback re-arms itself until a
deadline really passed, and it is moved earlier once when the answer starts, so a stall after a
few tokens is cut after `idle_timeout_s`, not at the first-byte deadline. The first-byte
timeout is per try: when it cuts an attempt that sent the client nothing, the handler may take
the cut back (`retry_first_byte`) and try another replica, its first-byte clock started anew
(the total one goes on). A stream whose idle
deadline passes while kvgate is blocked handing a chunk to the client (`writing`, set only
inside `hand_over`, so it is never left on by a cut: the client stopped reading and its socket
is full) is the client's stall, not the replica's: reason ``"client"``. Whether the cut found
such a write blocked is kept (`blocked`): an error event after it would wait on that client.
A stream's last piece, sent once the answer is whole (`end`), is bounded the same way.
An attempt waits in kvgate for one of its replica's connections (`upstream.max_connections`)
before its request goes out: that wait is bounded by `upstream.connection_wait_s` (reason
``"connection wait"``, taken back for another try like a first-byte cut, never the replica's
failure), and the first-byte clock starts when the request is sent (`sent`), so a replica is
given its whole first-byte time whatever kvgate's own queue took. A replica whose engine is
found stalled (`gateway.stall`: requests running there, its token counters frozen for
`health.stall_after_s`) cuts its attempts whose answer has not started (`replica_stalled`,
reason ``"stall"``): taken back for another try like a first-byte cut -- the only bound a
non-streamed answer has before the total timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.asgi import Send
from gateway.config import UpstreamConfig
from gateway.drain import SHUTDOWN
from gateway.errors import (
    KvgateError,
    NoReplicaAvailable,
    ReplicaConnectionsBusy,
    UpstreamTimeout,
)

__all__ = ["Canceller", "cut_error", "stall_error"]


class Canceller:
    __slots__ = (
        "_attempt",
        "_cfg",
        "_first",
        "_first_s",
        "_handle",
        "_later",
        "_loop",
        "_queued",
        "_start",
        "_task",
        "_watch",
        "blocked",
        "done",
        "last",
        "reason",
        "stalled",
        "writing",
    )

    def __init__(
        self, cfg: UpstreamConfig, receive: Callable[[], Awaitable[Any]], *, whole: bool = False
    ) -> None:
        """``whole``: the answer comes whole (not streamed): no first-byte deadline."""
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cfg = cfg
        self._first_s = cfg.total_timeout_s if whole else cfg.first_byte_timeout_s
        self._start = self._attempt = self.last = self._loop.time()
        self._first = True  # waiting for response headers
        self._queued = False  # waiting for a connection to the replica (`attempt_started`)
        self.done = False  # the response is complete: nothing may cancel any more
        # "disconnect" | "first byte" | "idle" | "client" (stopped reading) | "total" |
        # "stall" (its replica's engine stopped making progress)
        self.reason: str | None = None
        self._later: str | None = None  # a reason that fired after `reason` (kept for a retry)
        self.writing = False  # a chunk is being handed to the client (`hand_over`)
        self.blocked = False  # the cut came while one was (the client is not reading)
        self.stalled = False  # the answer's last piece was not taken in time (`end`)
        # (the earliest deadline an attempt may have: no re-arming per request)
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(
            self._start + min(self._first_s, cfg.total_timeout_s, cfg.connection_wait_s),
            self._check)
        self._watch = self._loop.create_task(self._watch_disconnect(receive))

    async def _watch_disconnect(self, receive: Callable[[], Awaitable[Any]]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.fire("disconnect")
                return

    def attempt_started(self) -> None:
        """A new upstream attempt, waiting for a connection to its replica until `sent`
        (bounded by `connection_wait_s`; the total clock goes on)."""
        self._attempt = now = self._loop.time()
        self._first = self._queued = True
        self._sooner(now + self._cfg.connection_wait_s)

    def sent(self) -> None:
        """The attempt's request goes out: its first-byte clock starts now."""
        self._attempt = now = self._loop.time()
        self._queued = False
        self._sooner(now + self._first_s)

    def _sooner(self, phase: float) -> None:
        """Re-arm the timer when the phase's deadline comes before the time it is set for
        (a later one is found when it fires: nothing to do per request on the usual path;
        it is never set past the total deadline)."""
        handle = self._handle
        if handle is not None and phase < handle.when():
            self._rearm()

    def retry_first_byte(self) -> bool:
        """Take back a first-byte cut (or a connection wait's) so the handler can try another
        replica (the caller checked that nothing reached the client): False when the cut had
        another reason. The next attempt's own clocks start now; the total deadline stays.
        A stalled replica's cut (`replica_stalled`) is taken back alike, and so is an idle
        cut of an answer nothing of which reached the client (the caller checked): a whole
        answer whose head came and then its body stopped (vLLM sends a whole answer's head
        with all of it) was the client's 504, where another replica could answer."""
        if self.reason not in ("first byte", "connection wait", "stall", "idle") or self.done:
            return False
        if self._later is not None:  # the client left, or shutdown came, meanwhile: no retry
            self.reason = self._later
            return False
        self.reason = None
        self.blocked = False  # the next try's writes start afresh
        self._task.uncancel()
        self.attempt_started()
        self._rearm()
        return True

    def replica_stalled(self) -> None:
        """The attempt's replica stopped making progress: cut it (waiting for one of its
        connections too), unless its answer started (a whole answer's headers come with all
        of it: vLLM finished it)."""
        if self._first:
            self.fire("stall")

    def headers_received(self) -> None:
        """A non-streamed answer's headers: the answer has started."""
        self.started()

    def started(self) -> None:
        """The answer has started (headers of a whole answer, or a stream's first event):
        from now on the idle timeout applies."""
        if not self._first:
            return
        self._first = False
        self.last = self._loop.time()
        self._rearm()

    def _rearm(self) -> None:
        if self.done or self.reason is not None:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._handle = self._loop.call_at(self._deadline()[0], self._check)

    async def hand_over(self, send: Send, body: bytes) -> None:
        """Send one more piece of the answer's body. A client that stops reading blocks here;
        `writing` says so to the timer while it does, and is reset however the send ends (a
        cut, a retry), or a later try's cut would pass for the client's."""
        self.writing = True
        try:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            self.writing = False

    async def end(self, send: Send, body: bytes) -> None:
        """Send the answer's last piece, once it is `done` (no timer cuts it any more). A
        client that has stopped reading blocks here as in `hand_over`: it waited for it as
        long as the client kept its connection open, the request counted in flight on its
        replica and its tenant. Past `idle_timeout_s` the client is `stalled` instead (the
        caller resets its connection)."""
        try:
            async with asyncio.timeout(self._cfg.idle_timeout_s):
                await send({"type": "http.response.body", "body": body, "more_body": False})
        except TimeoutError:
            self.stalled = True

    def touch(self) -> None:
        self.last = self._loop.time()

    def _deadline(self) -> tuple[float, str]:
        cfg = self._cfg
        total = self._start + cfg.total_timeout_s
        if self._queued:
            phase, reason = self._attempt + cfg.connection_wait_s, "connection wait"
        elif self._first:
            phase, reason = self._attempt + self._first_s, "first byte"
        else:
            phase = self.last + cfg.idle_timeout_s
            reason = "client" if self.writing else "idle"
        return (phase, reason) if phase < total else (total, "total")

    def _check(self) -> None:
        self._handle = None
        deadline, reason = self._deadline()
        if self._loop.time() >= deadline:
            self.fire(reason)
        else:
            self._handle = self._loop.call_at(deadline, self._check)

    def fire(self, reason: str) -> None:
        if self.done:
            return
        if self.reason is not None:
            self._later = self._later or reason  # the first cut may be taken back
            return
        self.reason = reason
        self.blocked = self.writing
        self._task.cancel()

    def close(self) -> None:
        self.done = True
        if self._handle is not None:
            self._handle.cancel()
        self._watch.cancel()


def cut_error(reason: str | None) -> KvgateError:
    """What an answer cut by its `Canceller` tells the client (a JSON error before its
    stream started, an error event after): the shutdown grace ended, or a timeout."""
    if reason == SHUTDOWN:  # gateway/drain.py
        return NoReplicaAvailable("The gateway is shutting down; the response was interrupted.")
    if reason == "connection wait":
        return ReplicaConnectionsBusy()
    if reason == "stall":
        return stall_error()
    return UpstreamTimeout(f"The replica did not answer in time ({reason} timeout).")


def stall_error() -> UpstreamTimeout:
    """A try cut because its replica stalled or was found down (`Canceller.replica_stalled`)."""
    return UpstreamTimeout("The replica stopped making progress (its engine stalled, or it "
                           "stopped answering its health checks).", reason="stall")
