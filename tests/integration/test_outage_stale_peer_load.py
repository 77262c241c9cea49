"""Two gateways share one Redis with flow control on; long streams run on pool "q" through
both, Redis is SIGKILLed, the streams end while it is down, and Redis comes back empty on the
same port. Afterwards neither gateway may keep counting the other's finished streams: the
fleet-wide in-flight count each shows for the replica returns to zero, and a burst as large
as the replica's seats goes through the other gateway at once, not through its queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import openai

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    inflight,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc, redis_proc

ADMIN = "outage-stale-admin-token-0123456789"
SEATS = 3


def _fleet_inflight(base: str) -> int:
    with admin_client(base, ADMIN) as admin:
        pools = admin.get("/replicas").json()["data"]
    return sum(r["inflight_fleet"] for p in pools for r in p["replicas"])


def _stream(base: str, key: str, stop: threading.Event, done: list[int]) -> None:
    """A long stream its client stops (a chat UI's stop button) once ``stop`` is set."""
    sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    chunks = 0
    with sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a long story"}],
            max_tokens=2000, stream=True) as stream:
        for _ in stream:
            chunks += 1
            if stop.is_set():
                break
    done.append(chunks)


def test_peer_load_of_streams_ended_during_outage_is_not_kept(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    store, url = redis_proc()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    store.start()
    again: Proc | None = None
    try:
        _, sim = sim_factory("--latency-ms", "20", "--time-scale", "0.25", model="s")
        config = {"pools": {"q": {"served_model": "s", "replicas": [sim]}},
                  "models": {"m": {"default": "q"}},
                  "tiers": {"premium": {"limits": {"rpm": 6000, "tpm": 500000,
                                                   "max_concurrency": 10},
                                        "flow": {"max_wait_s": 3}}},
                  "routing": {"scrape_interval_ms": 50},
                  # peer_lag_ms ~0: no margin for peers' unseen sends (a gateway alone in a
                  # burst holds back its own recent sends for the lag, `routing.flow.unseen`,
                  # and would queue part of the burst below for that, stale load or not)
                  "flow": {"enabled": True, "max_inflight": SEATS, "peer_lag_ms": 0.001},
                  "tenancy": {"gateway_replicas": 2}}
        env = {"KVGATE_REDIS_URL": url, "KVGATE_SALT_SECRET": AUTH_SECRET,
               "KVGATE_ADMIN_TOKEN": ADMIN}
        gateways = [gateway_proc(config=config, env=env, auth=True) for _ in range(2)]
        procs = [gw.start() for gw, _ in gateways]
        a, b = (base for _, base in gateways)
        try:
            with admin_client(a, ADMIN) as admin:
                assert admin.post("/tenants", json={"id": "t", "tier": "premium"}
                                  ).status_code == 201
                key = admin.post("/tenants/t/keys").json()["key"]
            done: list[int] = []
            stop = threading.Event()
            threads = [threading.Thread(target=_stream, args=(base, key, stop, done),
                                        daemon=True)
                       for base in (a, a, b)]
            for t in threads:
                t.start()
            # both gateways see all three streams (their own and the peer's, over Redis)
            wait_for(lambda: _fleet_inflight(a) == SEATS and _fleet_inflight(b) == SEATS, 10,
                     "three streams in flight, seen fleet-wide")
            store.kill()  # SIGKILL: nothing said goodbye, nothing saved
            stop.set()  # the streams end while Redis is down
            for t in threads:
                t.join(10)
            assert len(done) == 3, "the streams ended"
            wait_for(lambda: sum(inflight(g) for g in (a, b)) == 0, 5, "streams over")
            time.sleep(0.3)  # the publishers have found Redis gone
            again, _ = redis_proc(port)
            again.start()  # empty
            # each gateway re-publishes what it holds now (nothing) and hears the other
            wait_for(lambda: all(httpx.get(f"{g}/readyz", timeout=5).status_code == 200
                                 for g in (a, b)), 15, "both gateways ready again")
            time.sleep(2.0)  # a few heartbeats each way
            seen = {g: _fleet_inflight(g) for g in (a, b)}
            assert seen == {a: 0, b: 0}, f"fleet-wide in flight after the streams ended: {seen}"
            queued = sum(metric_values(b, "kvgate_flow_queued_total").values())
            statuses: list[int] = []

            def one() -> None:
                sdk = openai.OpenAI(base_url=f"{b}/v1", api_key=key, max_retries=0,
                                    timeout=30)
                raw = sdk.chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": "x"}], max_tokens=20)
                statuses.append(raw.status_code)

            burst = [threading.Thread(target=one) for _ in range(SEATS)]
            for t in burst:
                t.start()
            for t in burst:
                t.join(30)
            assert statuses == [200] * SEATS
            assert sum(metric_values(b, "kvgate_flow_queued_total").values()) == queued
        finally:
            for proc in procs:
                proc.stop()
    finally:
        (again or store).stop()
