"""`server.workers 2`: one worker killed (SIGKILL, as the OOM killer does) while both carry
streams. The streams on the other worker all finish, the killed worker's fail with a
connection error (nothing else can be done for them), the worker is started again, and no
count is left behind: the replica runs nothing for the dead worker's streams and the
gateway's in-flight gauges come back to 0."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable

import httpx
import pytest

from tests.support.gateway import gateway_proc, inflight, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.slow

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]
STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}],
          "max_tokens": 1500, "stream": True, "ignore_eos": True}


class Stream(threading.Thread):
    """One stream on a connection of its own, which first asks /readyz which worker it is
    (the `sync.member` names the process)."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.pid = 0
        self.started = threading.Event()
        self.outcome = ""

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60,
                          limits=httpx.Limits(max_connections=1)) as c:
            self.pid = int(c.get("/readyz").json()["sync"]["member"].rsplit(":", 2)[1])
            try:
                with c.stream("POST", "/v1/chat/completions", json=STREAM) as r:
                    data = b""
                    for chunk in r.iter_bytes():
                        data += chunk
                        self.started.set()
                self.outcome = "done" if data.endswith(b"data: [DONE]\n\n") and \
                    b'"error"' not in data else f"cut: {data[-120:]!r}"
            except httpx.TransportError as exc:
                self.outcome = f"connection error: {type(exc).__name__}"
            finally:
                self.started.set()


def _children(proc: Proc) -> set[int]:
    assert proc.popen is not None
    out = subprocess.run(["pgrep", "-P", str(proc.popen.pid)], capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


def test_the_other_workers_streams_finish_and_no_count_is_left(
    redis_url: str, sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory()
    config = {"pools": {"p": {"replicas": [sim], "served_model": MODEL}},
              "models": {MODEL: {"default": "p"}}, "server": {"workers": 2}}
    gw, base = gateway_proc(config=config, env={"KVGATE_REDIS_URL": redis_url})
    with gw:
        workers = _children(gw)
        streams: list[Stream] = []
        while len({s.pid for s in streams}) < 2 and len(streams) < 24:  # both carry some
            streams.append(Stream(base))
            streams[-1].start()
            assert streams[-1].started.wait(20)
        victim = streams[0].pid
        os.kill(victim, signal.SIGKILL)
        for s in streams:
            s.join(60)
        outcomes = {s.outcome for s in streams if s.pid != victim}
        assert outcomes == {"done"}, [(s.pid, s.outcome) for s in streams]
        assert all(s.outcome.startswith("connection error") for s in streams
                   if s.pid == victim), [(s.pid, s.outcome) for s in streams]
        wait_for(lambda: len(_children(gw) - {victim}) == 2, timeout=20,
                 what="the killed worker started again")
        assert _children(gw) & workers == workers - {victim}
        for _ in range(6):  # new connections reach either worker: both serve
            with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
                assert c.get(f"{base}/readyz", timeout=5).status_code == 200
        wait_for(lambda: httpx.get(f"{sim}/sim/stats", timeout=5).json()["in_flight"] == 0,
                 what="the replica running nothing for the dead worker's streams")
        # another worker's part of /metrics may be a few seconds old (`gateway.worker_metrics`)
        wait_for(lambda: inflight(base) == 0, timeout=15, what="in-flight gauges back to 0")
