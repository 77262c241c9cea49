"""Graceful shutdown: let in-flight requests finish for the grace period, then end them cleanly.

uvicorn's own shutdown waits `timeout_graceful_shutdown` and then cancels the request tasks:
a stream is cut mid-event with neither an error event nor ``[DONE]``, counted as a success,
and the process then re-raises the signal it caught (exit status 143 for SIGTERM).
`KvgateServer` instead, when `server.shutdown_grace_s` has passed, *interrupts* every
proxied request still running (`interrupt_all`: its canceller fires with reason
``"shutdown"``; the proxy ends a stream with an SSE error event and ``data: [DONE]``, answers
a request that had not started with a 503, and records it as interrupted), and stops
reading every body still arriving (a slow upload: a 503 too, `request.read_body`; left to
uvicorn, its task was cancelled at exit and the client got a text/plain 500), gives them
`INTERRUPT_WAIT_S` to send that, and exits with status 0 after a signal-initiated shutdown.

A request still waiting in flow control's queue when shutdown starts is not sent during the
grace (it would start a stream the grace may cut): `interrupt_waiting` answers it 503 at once.

SIGHUP is logged and ignored while the server runs (`ignore_hangup`): kvgate has no
configuration reload, and the signal's default action (uvicorn takes SIGTERM and SIGINT only)
killed the process at once, every stream in flight cut without an error event or a drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Protocol

import uvicorn

__all__ = [
    "HANGUP_IGNORED", "INTERRUPT_WAIT_S", "SHUTDOWN", "KvgateServer", "grace_timeout",
    "ignore_hangup", "interrupt_all",
    "interrupt_waiting", "interruptible", "waiting",
]

log = logging.getLogger(__name__)

SHUTDOWN = "shutdown"  # the canceller reason of a request interrupted by shutdown
INTERRUPT_WAIT_S = 2.0  # after the grace period, time for interrupted requests to say so
HANGUP_IGNORED = ("SIGHUP received and ignored: kvgate does not reload its configuration; "
                  "restart it to apply a change (SIGTERM drains the requests in flight first)")


@contextlib.contextmanager
def ignore_hangup(say: Callable[[str], None]) -> Iterator[None]:
    """SIGHUP only `say`s `HANGUP_IGNORED` while this lasts (then the previous handler is
    back). Without a SIGHUP on this platform, nothing."""
    hup = getattr(signal, "SIGHUP", None)
    if hup is None:
        yield
        return
    previous = signal.signal(hup, lambda _signum, _frame: say(HANGUP_IGNORED))
    try:
        yield
    finally:
        signal.signal(hup, previous)


class _Firable(Protocol):
    def fire(self, reason: str) -> None: ...


_LIVE: set[_Firable] = set()
_WAITING: set[_Firable] = set()  # requests not sent yet: answered when shutdown starts


class _Registered:
    """`interruptible`'s block: a class, not a generator's context manager (about half its
    cost, timeit: every proxied request enters two, its body's read and its answer's)."""

    __slots__ = ("_canceller", "_into")

    def __init__(self, canceller: _Firable, into: set[_Firable]) -> None:
        self._canceller = canceller
        self._into = into

    def __enter__(self) -> None:
        self._into.add(self._canceller)

    def __exit__(self, *exc: object) -> None:
        self._into.discard(self._canceller)


def interruptible(canceller: _Firable) -> _Registered:
    """Register a running request's canceller for `interrupt_all` while the block runs."""
    return _Registered(canceller, _LIVE)


def waiting(canceller: _Firable) -> _Registered:
    """Register a request waiting to be sent (flow control's queue) for `interrupt_waiting`
    while the block runs."""
    return _Registered(canceller, _WAITING)


def interrupt_all() -> int:
    """Fire every registered canceller with reason "shutdown"; returns how many."""
    return _fire(_LIVE)


def interrupt_waiting() -> int:
    """Shutdown starts: fire the cancellers of the requests waiting to be sent; returns how
    many."""
    return _fire(_WAITING)


def _fire(registered: set[_Firable]) -> int:
    live = list(registered)
    for canceller in live:
        canceller.fire(SHUTDOWN)
    return len(live)


class KvgateServer(uvicorn.Server):
    """uvicorn's server with kvgate's end of grace (see the module docstring).

    Pass `grace_s`; uvicorn's own `timeout_graceful_shutdown` must be at least
    ``grace_s + INTERRUPT_WAIT_S`` (`grace_config` sets it) so that it never cancels first.
    """

    def __init__(
        self, config: uvicorn.Config, grace_s: float,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.grace_s = grace_s
        self.on_started = on_started  # called once listening with the app started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    async def _wait_tasks_to_complete(self) -> None:
        queued = interrupt_waiting()
        # what the drain waits for, and how long at most: uvicorn says only "Waiting for
        # connections to close", as for idle keep-alive connections
        log.info("shutting down: draining %d requests in flight for up to %g s "
                 "(server.shutdown_grace_s)", len(_LIVE), self.grace_s,
                 extra={"inflight": len(_LIVE), "queued_refused": queued,
                        "grace_s": self.grace_s})
        wait = super()._wait_tasks_to_complete
        try:
            async with asyncio.timeout(self.grace_s):
                await wait()
            log.info("drained: every request in flight finished")
            return
        except TimeoutError:
            pass
        n = interrupt_all()
        log.warning("shutdown grace period over: interrupting in-flight requests",
                    extra={"interrupted": n, "grace_s": self.grace_s})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(INTERRUPT_WAIT_S):
                await wait()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """As uvicorn's, without re-raising the caught signal once shut down: a graceful
        stop on SIGTERM/SIGINT is a clean exit (status 0), not death by signal. SIGHUP is
        logged and ignored (`ignore_hangup`)."""
        with super().capture_signals(), ignore_hangup(log.warning):
            try:
                yield
            finally:
                self._captured_signals.clear()


def grace_timeout(grace_s: float) -> int:
    """uvicorn's `timeout_graceful_shutdown` for a kvgate grace period: a backstop only."""
    return int(grace_s + INTERRUPT_WAIT_S) + 2
