"""Route explain says a request would queue when the pool's only replica is backing off after
vLLM's busy 503, as flow control then queues it.

Flow control takes a replica backing off after a busy 503 as there and full (it queues for
it rather than send it what it just refused); explain read the same replica as gone, so the
pool was "not saturated" and a request "would not queue" while every request of the pool
queued (and ``GET /admin/replicas`` said saturated).

One real gateway with Redis in front of one simulated replica that admits one request at a
time (``--max-num-queued-reqs 1``, vLLM's admission limit) and whose streams hang: a filler
stream holds it, the next request is answered busy, and the replica is kept from new picks
for ``health.busy_backoff_s``.
"""

from __future__ import annotations

import contextlib
import threading
import uuid

import httpx
import openai

from tests.support.gateway import (
    AUTH_SECRET,
    FAST_HEALTH,
    admin_client,
    gateway_proc,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc, redis_proc, sim_proc

ADMIN = "flow-explain-busy-admin-token-0123456789"
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _start(procs: list[Proc]) -> str:
    redis, url = redis_proc()
    procs.append(redis.start())
    sim, sim_url = sim_proc(None, "--max-num-queued-reqs", "1", "--hang-after-tokens", "5",
                            model="m")
    procs.append(sim.start())
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim_url]}},
              "models": {"llama": {"default": "p"}},
              "tiers": {"free": {"flow": {"max_wait_s": 2}}},
              "health": {**FAST_HEALTH, "busy_backoff_s": 30, "busy_backoff_max_s": 30},
              "flow": {"enabled": True}}
    env = {"KVGATE_REDIS_URL": url, "KVGATE_SALT_SECRET": AUTH_SECRET,
           "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    procs.append(gw.start())
    return base


def _depth(base: str) -> float:
    return sum(metric_values(base, "kvgate_flow_queue_depth").values())


def test_explain_says_a_request_queues_for_a_replica_backing_off_after_busy() -> None:
    procs: list[Proc] = []
    try:
        base = _start(procs)
        tid = f"t-{uuid.uuid4().hex[:8]}"
        with admin_client(base, ADMIN) as admin:
            assert admin.post("/tenants", json={"id": tid, "tier": "free"}).status_code == 201
            key = str(admin.post(f"/tenants/{tid}/keys").json()["key"])
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
        with httpx.Client(timeout=30) as filler:
            resp = filler.send(filler.build_request(
                "POST", f"{base}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={**CHAT, "stream": True, "max_tokens": 50, "ignore_eos": True}),
                stream=True)
            assert resp.status_code == 200
            chunks = resp.iter_raw()
            next(chunks)  # the replica's one admission is taken
            try:  # answered busy by the replica: it backs off for busy_backoff_s
                _chat(client)
                raise AssertionError("the replica took a second request")
            except openai.APIStatusError as exc:
                assert exc.status_code in (429, 503)

            with admin_client(base, ADMIN) as admin:  # nothing queued yet
                flow = admin.post("/route/explain",
                                  json={"tenant": tid, "request": CHAT}).json()["flow"]
                pools = admin.get("/replicas").json()["data"]
            queued = threading.Thread(target=_ask, args=(client,), daemon=True)
            queued.start()  # and flow control queues it: the replica is there and full
            wait_for(lambda: _depth(base) == 1, 10, "the request to queue")
            queued.join(30)
        assert pools[0]["flow"]["saturated"]
        assert flow["saturated"] and flow["would_queue"], flow
        assert list(flow["replicas"].values()) != ["unhealthy"], flow
    finally:
        for proc in reversed(procs):
            proc.stop()


def _chat(client: openai.OpenAI) -> None:
    client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def _ask(client: openai.OpenAI) -> None:
    with contextlib.suppress(openai.APIStatusError):  # shed at its longest wait: the
        _chat(client)  # replica is still backing off
