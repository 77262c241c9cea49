"""`server.workers 2`: a worker killed (SIGKILL: the OOM killer, an operator) while it is
still starting is started again, as one killed while serving is. The replacement of a killed
worker was taken for a worker that failed at start: a second `kill -9`, reaching the
replacement before it served, stopped the whole gateway (exit 1). A worker that exits by
itself before it serves still stops the gateway (tests/integration/test_worker_faults.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc, free_port

pytestmark = pytest.mark.slow

MODEL = "sim-model"
HEALTH_WAIT_S = 2.5  # how long each worker's start waits on the silent replica's /health


@contextmanager
def _silent_replica() -> Iterator[str]:
    """A replica that takes connections and never answers: a worker's start waits
    `HEALTH_WAIT_S` on its first /health poll, so a worker being started can be seen."""
    port = free_port()
    server = socket.create_server(("127.0.0.1", port))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(5)
        for conn in (*held, server):
            conn.close()


def _children(proc: Proc) -> set[int]:
    assert proc.popen is not None
    out = subprocess.run(["pgrep", "-P", str(proc.popen.pid)], capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


def _replaced(gw: Proc, known: set[int]) -> Callable[[], bool]:
    """True once one new worker runs; fails at once, with the log, if the gateway stopped."""
    def new_one() -> bool:
        assert gw.popen is not None and gw.popen.poll() is None, gw.output()
        return len(_children(gw) - known) == 1
    return new_one


def _members(base: str) -> set[int]:
    """The worker pids answering /readyz on new connections (a few tries)."""
    seen = set()
    for _ in range(8):
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
            seen.add(int(c.get(f"{base}/readyz", timeout=10).json()["sync"]["member"]
                         .split(":")[1]))
    return seen


def test_a_worker_killed_before_it_serves_is_started_again(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, sim = sim_factory()
    with _silent_replica() as silent:
        gw, base = gateway_proc(config={
            "pools": {"p": {"replicas": [sim, silent], "served_model": MODEL}},
            "models": {MODEL: {"default": "p"}}, "server": {"workers": 2},
            "health": {"interval_s": 60, "timeout_s": HEALTH_WAIT_S},
        }, env={"KVGATE_REDIS_URL": redis_url})
        with gw:
            first = _children(gw)
            os.kill(min(first), signal.SIGKILL)  # serving: it is replaced
            wait_for(_replaced(gw, first), timeout=30, what="the killed worker's replacement")
            (replacement,) = _children(gw) - first
            os.kill(replacement, signal.SIGKILL)  # still waiting on the silent replica
            wait_for(_replaced(gw, first | {replacement}), timeout=30,
                     what="the replacement's replacement")
            (third,) = _children(gw) - first - {replacement}
            wait_for(lambda: third in _members(base), timeout=60,
                     what="the third worker of the slot serving")
            assert "failed to start" not in gw.output()
