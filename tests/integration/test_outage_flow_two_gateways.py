"""Two gateways share one Redis (rate limits: rpm, tpm, concurrency) with flow control queueing
in front of a saturated replica; Redis stops under load and comes back on the same port (its
append-only file kept the leases of the requests then in flight). Afterwards nothing stays
counted: no request in flight, no queue, no concurrency lease left in Redis, and a burst of
as many requests as the tenant may run at once is served -- no 429 stuck after the outage.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import redis

from tests.support.gateway import (
    AUTH_SECRET,
    admin_client,
    gateway_proc,
    inflight,
    metric_values,
    persistent_redis,
    wait_for,
)
from tests.support.procs import Proc

ADMIN = "outage-flow-admin-token-0123456789"
CONCURRENCY = 6


class Load:
    """Clients sending small requests through both gateways until stopped."""

    def __init__(self, bases: list[str], key: str, clients: int) -> None:
        self.bases, self.key = bases, key
        self.statuses: dict[int | str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(clients)]

    def _run(self, i: int) -> None:
        body = {"model": "m", "max_tokens": 30, "stream": i % 2 == 0,
                "messages": [{"role": "user", "content": f"hello {i}"}]}
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                try:
                    status: int | str = c.post(
                        f"{self.bases[i % 2]}/v1/chat/completions", json=body,
                        headers={"Authorization": f"Bearer {self.key}"}).status_code
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                with self._lock:
                    self.statuses[status] = self.statuses.get(status, 0) + 1
                if status == 429:
                    time.sleep(0.1)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(40)


def test_counters_and_queues_return_to_zero_after_redis_comes_back(
        tmp_path: Path, sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    store, url, port = persistent_redis(str(tmp_path))
    store.start()
    again: Proc | None = None
    try:
        _, sim = sim_factory("--max-num-seqs", "2", "--latency-ms", "20", "--time-scale", "5",
                             model="s")
        config = {"pools": {"p": {"served_model": "s", "replicas": [sim]}},
                  "models": {"m": {"default": "p"}},
                  "tiers": {"free": {"limits": {"rpm": 6000, "tpm": 200000,
                                                "max_concurrency": CONCURRENCY}}},
                  "routing": {"scrape_interval_ms": 50},
                  "flow": {"enabled": True, "max_waiting": 0, "max_unanswered": 1},
                  "tenancy": {"gateway_replicas": 2}}
        env = {"KVGATE_REDIS_URL": url, "KVGATE_SALT_SECRET": AUTH_SECRET,
               "KVGATE_ADMIN_TOKEN": ADMIN}
        gateways = [gateway_proc(config=config, env=env, auth=True) for _ in range(2)]
        procs = [gw.start() for gw, _ in gateways]
        bases = [base for _, base in gateways]
        try:
            with admin_client(bases[0], ADMIN) as admin:
                assert admin.post("/tenants", json={"id": "t", "tier": "free"}).status_code \
                    == 201
                key = admin.post("/tenants/t/keys").json()["key"]
            with Load(bases, key, clients=8) as load:
                wait_for(lambda: load.statuses.get(200, 0) >= 20, 20, "load served")
                queued = sum(sum(metric_values(b, "kvgate_flow_queued_total").values())
                             for b in bases)
                assert queued > 0  # flow control is part of what is probed
                store.stop()
                time.sleep(3)
                again, _, _ = persistent_redis(str(tmp_path), port)
                again.start()
                served = load.statuses.get(200, 0)
                wait_for(lambda: load.statuses.get(200, 0) >= served + 20, 20,
                         "load served after Redis came back")
            assert not [s for s in load.statuses if s not in (200, 429)], load.statuses
            wait_for(lambda: sum(inflight(b) for b in bases) == 0, 10, "nothing in flight")
            for base in bases:
                assert sum(metric_values(base, "kvgate_flow_queue_depth").values()) == 0
            client = redis.Redis.from_url(url)
            try:
                wait_for(lambda: all(client.zcard(k) == 0 for k in client.scan_iter("*:leases")),
                         10, "no concurrency lease left in Redis")
            finally:
                client.close()
            burst: list[int] = []

            def one(base: str) -> None:
                sdk = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                                    timeout=30)
                raw = sdk.chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": "x"}], max_tokens=5)
                burst.append(raw.status_code)

            threads = [threading.Thread(target=one, args=(bases[i % 2],))
                       for i in range(CONCURRENCY)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert burst == [200] * CONCURRENCY
        finally:
            for proc in procs:
                proc.stop()
    finally:
        (again or store).stop()
