"""`server.workers 2`, one worker stuck (SIGSTOP: a debugger, a frozen cgroup, an event loop
blocked in C) when the gateway is told to stop. Its sibling serves meanwhile; the supervisor
passes SIGTERM on, which a stopped process never takes, and waited for it for good: the
gateway never exited (an orchestrator's SIGKILL ended it, the workers' shared directory and
the stuck worker's leases left behind). Now a worker still alive `server.shutdown_grace_s`
plus `gateway.workers.KILL_AFTER_S` after the signal (`KILL_AFTER_S` after a second signal,
whatever the grace) is killed, said in the log, and the gateway exits."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc

pytestmark = pytest.mark.slow

MODEL = "sim-model"


def _children(proc: Proc) -> list[int]:
    assert proc.popen is not None
    out = subprocess.run(["pgrep", "-P", str(proc.popen.pid)], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


@pytest.mark.parametrize(("grace_s", "signals"), [(1, [signal.SIGTERM]),
                                                  (600, [signal.SIGINT, signal.SIGINT])])
def test_a_stopped_worker_does_not_hold_the_gateway_s_exit(
    sim_factory: Callable[..., tuple[Proc, str]], grace_s: int, signals: list[signal.Signals],
) -> None:
    _, sim = sim_factory("--time-scale", "50")
    redis, redis_url = redis_proc()
    config = {"pools": {"p": {"replicas": [sim], "served_model": MODEL}},
              "models": {MODEL: {"default": "p"}},
              "server": {"workers": 2, "shutdown_grace_s": grace_s}}
    gw, base = gateway_proc(config=config, env={"KVGATE_REDIS_URL": redis_url})
    with redis, gw:
        wait_for(lambda: len(_children(gw)) == 2, timeout=20, what="two workers")
        stuck, sibling = _children(gw)
        os.kill(stuck, signal.SIGSTOP)
        try:
            # the sibling takes every new connection: nothing is lost while one is stopped
            fresh = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                   timeout=30, http_client=fresh)  # type: ignore[arg-type]
            for i in range(6):
                reply = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": f"hi {i}"}],
                    max_tokens=2)
                assert reply.choices[0].message.content is not None
            fresh.close()
            for i, sig in enumerate(signals):
                if i:  # a second signal once the first was taken: the sibling has stopped
                    wait_for(lambda: f"Finished server process [{sibling}]" in gw.output(None),
                             timeout=20, what="the sibling stopped")
                gw.signal(sig)
            assert gw.popen is not None
            try:
                code = gw.popen.wait(60)  # a liveness bound: it waited for good
            except subprocess.TimeoutExpired:
                pytest.fail("the gateway did not exit with a worker stopped:\n" + gw.output())
        finally:
            if os.path.exists(f"/proc/{stuck}"):
                os.kill(stuck, signal.SIGCONT)
        assert code == 0, gw.output()
        out = gw.output(None)
        assert "still running" in out and "killing it" in out, out[-3000:]
        assert not [pid for pid in (stuck, sibling) if os.path.exists(f"/proc/{pid}")]
