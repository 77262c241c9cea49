"""A request shed at its longest wait from a queue that did not move while it waited is told
to come back after at least that wait, not after 1 s.

The Retry-After of a shed request is the time the queue ahead of it takes to drain at the
pool's recent dispatch rate. When the pool stalls (its replicas hold their requests), the
rate of what went before the stall decays but stays above zero, so the estimate is the
queue left ahead of the request over that rate: the last request shed, with nothing left
ahead, was told 1 s (measured: four requests shed together after 30 s in a pool that sent
nothing meanwhile were told 48, 30, 16 and 1 s), and came back at once to wait its whole
longest wait again.

One real gateway with Redis in front of one simulated replica whose streams hang after a few
tokens; ``flow.max_inflight: 1`` makes the pool saturated while one filler stream runs. The
official openai client sends the queued requests.
"""

from __future__ import annotations

import threading
import uuid
from functools import partial

import httpx
import openai

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "flow-stalled-admin-token-0123456789"
MAX_WAIT_S = 2


def _stack(procs: list[Proc]) -> str:
    redis, url = redis_proc()
    procs.append(redis.start())
    sim, sim_url = sim_proc(None, "--hang-after-tokens", "5", model="m")
    procs.append(sim.start())
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim_url]}},
              "models": {"llama": {"default": "p"}},
              "tiers": {"free": {"flow": {"max_wait_s": MAX_WAIT_S}}},
              "flow": {"enabled": True, "max_inflight": 1}}
    env = {"KVGATE_REDIS_URL": url, "KVGATE_SALT_SECRET": AUTH_SECRET,
           "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    procs.append(gw.start())
    return base


def _key(base: str) -> str:
    tid = f"t-{uuid.uuid4().hex[:8]}"
    with admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": tid, "tier": "free"}).status_code == 201
        return str(admin.post(f"/tenants/{tid}/keys").json()["key"])


def _queued(base: str, n: int) -> bool:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values()) == n


class Shed(threading.Thread):
    """One request sent while the pool is stalled: its status and Retry-After."""

    def __init__(self, base: str, key: str) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                                    timeout=30)
        self.status = 0
        self.retry_after: str | None = None

    def run(self) -> None:
        try:
            self.client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "queued"}], max_tokens=2)
            self.status = 200
        except openai.APIStatusError as exc:
            self.status = exc.status_code
            self.retry_after = exc.response.headers.get("retry-after")


def test_requests_shed_from_a_stalled_queue_are_told_at_least_their_wait() -> None:
    procs: list[Proc] = []
    try:
        base = _stack(procs)
        key = _key(base)
        with httpx.Client(timeout=30) as filler:
            resp = filler.send(filler.build_request(
                "POST", f"{base}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": "llama", "stream": True, "max_tokens": 50, "ignore_eos": True,
                      "messages": [{"role": "user", "content": "filler"}]}), stream=True)
            assert resp.status_code == 200
            chunks = resp.iter_raw()
            next(chunks)  # it holds the pool's only seat, and its replica hangs
            calls = [Shed(base, key) for _ in range(2)]
            for n, call in enumerate(calls, 1):
                call.start()
                wait_for(partial(_queued, base, n), 10, f"{n} queued")
            for call in calls:
                call.join(30)
        assert [c.status for c in calls] == [429, 429]
        for call in calls:  # nothing went while they waited MAX_WAIT_S: not 1 s
            assert call.retry_after is not None and int(call.retry_after) >= MAX_WAIT_S
    finally:
        for proc in reversed(procs):
            proc.stop()
