"""`server.workers 2` beside another gateway: a worker killed (SIGKILL, the OOM killer) while
it carries streams. Its supervisor says its goodbye on the shared routing state, so its
load leaves the other processes' views at once, as a worker's own goodbye on a clean stop
does. Before, it stayed in their bounded-load rule and cost model until its records aged
out (``sync.stale_after_s``: here 30 s, to tell the two apart)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from contextlib import ExitStack

import httpx
import pytest

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.slow

MODEL = "sim-model"
ADMIN = "fleet8-killed-worker-admin-token"
STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "a long story"}],
          "max_tokens": 1500, "stream": True, "ignore_eos": True}


class Stream(threading.Thread):
    """One stream on a connection of its own, which first asks /readyz which worker it is."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.pid = 0
        self.started = threading.Event()
        self.ended = False

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.base, timeout=60,
                              limits=httpx.Limits(max_connections=1)) as c:
                self.pid = int(c.get("/readyz").json()["sync"]["member"].rsplit(":", 2)[1])
                with c.stream("POST", "/v1/chat/completions", json=STREAM) as r:
                    for _ in r.iter_bytes():
                        self.started.set()
        except httpx.TransportError:
            pass
        finally:
            self.ended = True
            self.started.set()


def _fleet_inflight(base: str) -> int:
    """The fleet's in-flight requests over all replicas in the view of `base`."""
    body = httpx.get(f"{base}/admin/replicas", timeout=5,
                     headers={"Authorization": f"Bearer {ADMIN}"}).json()
    found: list[int] = []

    def walk(o: object) -> None:
        if isinstance(o, dict):
            if "inflight_fleet" in o:
                found.append(int(o["inflight_fleet"]))
            else:
                for v in o.values():
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(body)
    return sum(found)


def test_a_killed_workers_load_leaves_the_other_gateways_view_at_once(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, sim = sim_factory("--time-scale", "0.5")
    config = {"pools": {"p": {"replicas": [sim], "served_model": MODEL}},
              "models": {MODEL: {"default": "p"}}, "sync": {"stale_after_s": 30}}
    env = {"KVGATE_REDIS_URL": redis_url, "KVGATE_ADMIN_TOKEN": ADMIN}
    with ExitStack() as stack:
        other, watcher = gateway_proc(config=config, env=env)
        stack.enter_context(other)
        workers, base = gateway_proc(config={**config, "server": {"workers": 2}}, env=env)
        stack.enter_context(workers)
        streams: list[Stream] = []
        while len({s.pid for s in streams}) < 2 and len(streams) < 24:  # both carry some
            streams.append(Stream(base))
            streams[-1].start()
            assert streams[-1].started.wait(20)
        wait_for(lambda: _fleet_inflight(watcher) == sum(not s.ended for s in streams),
                 what="every stream in the other gateway's view")
        victim = streams[0].pid
        os.kill(victim, signal.SIGKILL)
        survivors = [s for s in streams if s.pid != victim]
        # well within the 30 s its records would take to age out
        wait_for(lambda: _fleet_inflight(watcher) == sum(not s.ended for s in survivors),
                 timeout=10, what="the killed worker's load gone from the other gateway")
