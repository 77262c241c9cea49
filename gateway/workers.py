"""`server.workers`: several gateway processes serving one port, deciding as one.

The parent binds the listening sockets once (a port in use is still one line), then forks
the workers; each inherits the sockets and runs a whole gateway (its own event loop, pools,
router and lifespan). The kernel hands each accepted connection to one of the processes
waiting on the shared socket. The workers share routing state like separate gateway replicas
do: through Redis (`gateway.fleet`), so ``workers > 1`` needs ``KVGATE_REDIS_URL``. With the
in-memory store each worker would hold its own tenants, keys, limits and routing state, so
that combination is refused at start.

The parent only supervises: SIGTERM/SIGINT are passed on to every worker (each drains its
in-flight requests for ``server.shutdown_grace_s``) and the parent closes its own copy of the
listening sockets, so a new connection is refused at once instead of waiting in the listen
backlog until the last worker has drained. A worker still alive `KILL_AFTER_S` (more with a slow
Redis configured: `kill_margin`) past ``server.shutdown_grace_s`` after the first signal (or
that margin after a second one, if sooner) is
stuck -- stopped (SIGSTOP takes no SIGTERM until it is resumed), its event loop blocked -- and
is killed (SIGKILL, logged): the supervisor waited for it for good, and the gateway never
exited by itself. A second signal (a second Ctrl-C) stops the workers
at once, as it stops a one-process gateway: they get SIGINT, which uvicorn takes, once it is
draining, as a forced exit. SIGHUP is logged and ignored, by the parent and by each worker
(`drain.ignore_hangup`): it killed the parent, and the workers drained and stopped after it.
A worker that dies after it started serving is
started again, however soon (the OOM killer does not wait), and so is one killed by a signal
before it served (the replacement of a killed worker, killed in turn); a worker that exits by
itself before it started serving failed at start and stops them all (exit status 1): the next
would fail alike, as would a slot's fourth worker in a row killed before it served. Each
worker says when it serves through an event the parent watches. A worker that
dies leaves its tenants' concurrency leases in Redis: the parent deletes its lease holder's
heartbeat as it sees it die, so they stop counting at once (`gateway.tenancy.holders`).
/metrics answers with every worker's series, labelled by worker (`gateway.worker_metrics`); a
restarted worker's series carry on its predecessors' counts, which the parent folds into its
slot's base as it sees one die. The
workers' shared directory (their /metrics parts, the tenancy state a restarted worker starts
from) is removed by the parent as it exits, or, when it was killed, by the workers as they
exit.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from types import FrameType

from gateway.config import KvgateConfig
from gateway.drain import ignore_hangup
from gateway.fleet.farewell import member_note, say_goodbye
from gateway.tenancy.holders import forget_holder, holder_note
from gateway.worker_metrics import WorkerSlot, fold_dead, set_current

__all__ = ["WORKERS_NEED_REDIS", "run_workers", "workers_apart"]

log = logging.getLogger(__name__)

WORKERS_NEED_REDIS = (
    "server.workers > 1 needs KVGATE_REDIS_URL: the workers share tenants, limits and routing "
    "state through Redis (with the in-memory store each would have its own)"
)
POLL_S = 0.2
KILLED_IN_START = 3  # a slot's workers killed in a row before serving: then a failed start
# past the drain's grace (a second signal: at once), how long a worker's own shutdown (its
# lifespan's end: settles, Redis goodbyes, each bounded) may take before it is taken as stuck:
# at least this, and `TEARDOWN_REDIS_CALLS` x the largest Redis timeout it may wait on
# (`kill_margin`): a healthy worker on a slow Redis is not killed mid-goodbye
KILL_AFTER_S = 10.0
TEARDOWN_REDIS_CALLS = 4  # Redis calls in a row a worker's shutdown may wait out, at most


def kill_margin(cfg: KvgateConfig) -> float:
    """How long past the grace (or a second signal) a worker may take to shut down before it
    is killed: `KILL_AFTER_S`, or `TEARDOWN_REDIS_CALLS` x the largest Redis timeout its
    shutdown may wait on (``tenancy.redis_timeout_s``, ``sync.timeout_s``) when that is
    longer."""
    if cfg.redis_url is None:
        return KILL_AFTER_S
    timeouts = [cfg.tenancy.redis_timeout_s]
    if cfg.sync.enabled:
        timeouts.append(cfg.sync.timeout_s)
    return max(KILL_AFTER_S, TEARDOWN_REDIS_CALLS * max(timeouts))


def workers_apart(cfg: KvgateConfig) -> str | None:
    """The warning for workers that share tenancy through Redis but not routing state
    (``sync.enabled: false``): each routes alone, so prefix affinity stops at the worker."""
    if cfg.server.workers < 2 or cfg.redis_url is None or cfg.sync.enabled:
        return None
    return (f"server.workers {cfg.server.workers} with sync.enabled false: each worker routes "
            "on its own state (its prefix-cache index, its in-flight load), so the turns of a "
            "conversation reach different replicas as the kernel spreads connections over the "
            "workers; set sync.enabled: true to share it through Redis")


# serve(cfg, sockets, on_started): runs one gateway; calls on_started once it serves
Serve = Callable[[KvgateConfig, list[socket.socket], Callable[[], None]], int]


def run_workers(
    cfg: KvgateConfig, sockets: list[socket.socket], serve: Serve,
    serving: Callable[[], None] | None = None,
) -> int:
    """Run ``cfg.server.workers`` processes, each ``serve(cfg, sockets, ...)``; supervise them.
    ``serving`` is called once, when every worker serves for the first time."""
    ctx = multiprocessing.get_context("fork")  # inherits the bound sockets as they are
    workers: dict[int, tuple[BaseProcess, Event]] = {}  # slot -> (process, "it serves")
    generations: dict[int, int] = {}  # slot -> how many workers were started in it
    stopping: list[float] = []  # when each stop signal came (time.monotonic())
    try:  # each worker's part of /metrics goes there
        shared = Path(tempfile.mkdtemp(prefix="kvgate-workers-"))
    except OSError as exc:
        print(f"kvgate serve: cannot create the workers' directory: {exc} (set TMPDIR)",
              file=sys.stderr, flush=True)
        return 1

    def start(slot: int) -> None:
        if stopping:  # a signal came after the supervisor decided to restart this one
            return
        serving = ctx.Event()
        generation = generations[slot] = generations.get(slot, -1) + 1
        proc = ctx.Process(target=_worker, name=f"kvgate-{slot}", args=(
            serve, cfg, sockets, WorkerSlot(slot, shared, generation), serving, os.getpid()))
        proc.start()
        workers[slot] = (proc, serving)
        if stopping and proc.pid is not None:  # the signal came during `proc.start()`
            os.kill(proc.pid, signal.SIGTERM)

    def stop(signum: int, _frame: FrameType | None) -> None:
        # the first signal drains; another one (a second Ctrl-C) stops now: uvicorn takes a
        # SIGINT while it drains as a forced exit (the one-process gateway's behaviour)
        forward = signal.SIGINT if stopping else signal.SIGTERM
        if stopping and len(stopping) == 1:
            print("kvgate serve: second signal: stopping the workers now, without waiting for "
                  "the requests in flight", file=sys.stderr, flush=True)
        stopping.append(time.monotonic())
        # no worker is started again: the workers' copies, closed as each begins its drain,
        # were the last ones, and the kernel refuses new connections instead of queueing them
        for sock in sockets:
            sock.close()
        for proc, _ in workers.values():
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, forward)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with ignore_hangup(log.warning):  # (each worker's server says it of itself)
            for slot in range(cfg.server.workers):
                start(slot)
            def dead(slot: int) -> None:
                _free_leases(cfg, shared, slot)
                _say_goodbye(cfg, shared, slot)
                if not stopping:  # before its successor starts (none when the gateway stops)
                    try:
                        fold_dead(shared, slot, generations[slot])
                    except Exception:  # the supervisor must outlive a metrics fault
                        log.exception("a dead worker's counters could not be kept")

            return _supervise(workers, stopping, start, stop, serving, dead,
                              cfg.server.shutdown_grace_s, kill_margin(cfg))
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for sock in sockets:
            sock.close()
        shutil.rmtree(shared, ignore_errors=True)


def _supervise(
    workers: dict[int, tuple[BaseProcess, Event]], stopping: list[float],
    start: Callable[[int], None], stop: Callable[[int, FrameType | None], None],
    all_serving: Callable[[], None] | None, dead: Callable[[int], None], grace_s: float,
    margin_s: float,
) -> int:
    status = 0
    stuck = _Stuck(grace_s, margin_s)
    # a worker killed by a signal before it served (the OOM killer, `kill -9` of a worker being
    # started again) did not fail at start: it is started again, unless its slot's workers
    # keep being killed before they serve (a start that the host cannot afford)
    killed_in_start: dict[int, int] = {}
    while workers:
        time.sleep(POLL_S)
        stuck.kill_late(workers, stopping)
        if all_serving is not None and not stopping and all(
                up.is_set() for _, up in workers.values()):
            all_serving()
            all_serving = None
        for slot, (proc, serving) in list(workers.items()):
            if proc.is_alive():
                continue
            proc.join()
            del workers[slot]
            dead(slot)
            if stopping:
                continue
            code = proc.exitcode if proc.exitcode is not None else 1
            killed_in_start[slot] = 0 if serving.is_set() else killed_in_start.get(slot, 0) + 1
            if not serving.is_set() and (code >= 0 or killed_in_start[slot] > KILLED_IN_START):
                print(f"kvgate serve: worker {slot} failed to start ({_how(code)}); "
                      "stopping", file=sys.stderr, flush=True)
                status = 1
                stop(signal.SIGTERM, None)
                continue
            log.warning("worker exited (%s, %s); starting it again", _how(code),
                        "while it served" if serving.is_set() else "before it served",
                        extra={"worker": slot, "exitcode": code})
            start(slot)
    return status


class _Stuck:
    """The deadline of the workers' own exit once the gateway stops: the first signal plus
    the grace plus the margin (`kill_margin`), or the second signal plus the margin if that
    is sooner; those still alive then are killed."""

    def __init__(self, grace_s: float, margin_s: float = KILL_AFTER_S) -> None:
        self._grace_s = grace_s
        self._margin_s = margin_s
        self._killed: set[int] = set()

    def deadline(self, stopped_at: list[float]) -> float | None:
        """When the workers still alive are killed, from the times of the stop signals
        (each as it came: two within one poll are two signals, the second's time its own);
        None before the first."""
        if not stopped_at:
            return None
        at = stopped_at[0] + self._grace_s + self._margin_s
        if len(stopped_at) >= 2:
            at = min(at, stopped_at[1] + self._margin_s)
        return at

    def kill_late(self, workers: dict[int, tuple[BaseProcess, Event]],
                  stopped_at: list[float], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        at = self.deadline(stopped_at)
        if at is None or now < at:
            return
        for slot, (proc, _) in workers.items():
            if proc.pid is None or proc.pid in self._killed or not proc.is_alive():
                continue
            log.error("worker still running %.0f s after the stop signal (stopped or stuck?): "
                      "killing it", now - stopped_at[0], extra={"worker": slot, "pid": proc.pid})
            self._killed.add(proc.pid)
            with contextlib.suppress(ProcessLookupError):  # (ended and reaped meanwhile)
                os.kill(proc.pid, signal.SIGKILL)


def _how(exitcode: int) -> str:
    """A worker's end, as an operator reads it: 'killed by SIGKILL' or 'exit 3'."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit {exitcode}"


def _free_leases(cfg: KvgateConfig, shared: Path, slot: int) -> None:
    """A worker is gone: its tenants' concurrency leases stop counting now, not when its
    heartbeat expires (``tenancy.lease_holder_ttl_s``)."""
    if cfg.redis_url is not None:
        tcfg = cfg.tenancy
        forget_holder(cfg.redis_url.get_secret_value(), tcfg.namespace,
                      holder_note(shared, slot), tcfg.redis_timeout_s)


def _say_goodbye(cfg: KvgateConfig, shared: Path, slot: int) -> None:
    """A worker is gone: its load leaves the other processes' views now, not when its records
    age out (``sync.stale_after_s``). A worker that stopped cleanly said it itself: once more
    is harmless (its id is gone from their views)."""
    if cfg.redis_url is not None and cfg.sync.enabled:
        say_goodbye(cfg.redis_url.get_secret_value(), cfg.tenancy.namespace,
                    member_note(shared, slot), cfg.tenancy.redis_timeout_s)


def _worker(
    serve: Serve, cfg: KvgateConfig, sockets: list[socket.socket], slot: WorkerSlot,
    serving: Event, supervisor: int,
) -> None:
    """Worker ``slot``'s process; ``supervisor``: the pid of the process that forked it."""
    set_current(slot)
    # its own process group: a Ctrl-C at a terminal reaches the parent only, which passes on
    # one SIGTERM (a second signal would make the server skip its graceful drain)
    os.setpgrp()
    _die_with_parent()
    if os.getppid() != supervisor:  # it died before the line above: no signal will come
        _forget_state(slot)
        sys.exit(0)
    for s in (signal.SIGTERM, signal.SIGINT):  # the server installs its own on start
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the server says it (`ignore_hangup`)
    status = serve(cfg, sockets, serving.set)
    if os.getppid() != supervisor:
        _forget_state(slot)
    sys.exit(status)


def _forget_state(slot: WorkerSlot) -> None:
    """The supervisor was killed (SIGKILL: its own cleanup never ran): the directory holds the
    tenancy state (key hashes, the policy with its replicas' URLs), which must not outlive the
    gateway; the workers still running lose only their last writes."""
    shutil.rmtree(slot.directory, ignore_errors=True)


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when the supervisor dies (even by SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
