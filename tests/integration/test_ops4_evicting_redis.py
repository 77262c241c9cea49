"""A Redis that evicts any key when full (``maxmemory-policy allkeys-*`` with a ``maxmemory``)
may take kvgate's tenants, API keys, policy and leases at any moment: /readyz says so
(degraded, still 200) for as long as it is so. It was one log line at
start: /readyz read all well until keys vanished and clients got 401s. The eviction policy is
read again while the gateway runs (CONFIG SET at run time). A real gateway on a real Redis,
the official openai client; the store's re-read on a real Redis."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import httpx
import openai
import redis

from gateway.tenancy.redis_conn import connect_redis
from gateway.tenancy.redis_store import RedisStore
from tests.support.gateway import acme_gateway, admin_client, chat_status
from tests.support.procs import Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "ops4-evicting-admin-token-0123456789"


def _redis(policy: str) -> tuple[Proc, str, int]:
    exe = shutil.which("redis-server")
    assert exe is not None
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--maxmemory", "64mb", "--maxmemory-policy", policy]
    return Proc(cmd, ready_port=port), f"redis://127.0.0.1:{port}/0", port


def _tenancy(base: str) -> dict[str, Any]:
    answer = httpx.get(f"{base}/readyz", timeout=10)
    assert answer.status_code == 200  # degraded is no outage: still ready
    found: dict[str, Any] = answer.json()["tenancy"]
    return found


def test_an_evicting_redis_is_in_readyz(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    server, url, _ = _redis("allkeys-lru")
    with server:
        gw, base = acme_gateway(sim, url, ADMIN, {"rpm": 100})
        with gw, admin_client(base, ADMIN) as admin:
            tenancy = _tenancy(base)
            assert tenancy["degraded"] is True, tenancy
            assert "maxmemory-policy allkeys-lru" in tenancy["reason"]
            assert "noeviction" in tenancy["reason"]
            key = admin.post("/tenants/acme/keys").json()["key"]
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            assert chat_status(client) == 200  # served all the same


def test_a_redis_without_eviction_is_not_degraded(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    server, url, _ = _redis("noeviction")
    with server:
        gw, base = acme_gateway(sim, url, ADMIN, {"rpm": 100})
        with gw:
            tenancy = _tenancy(base)
            assert tenancy["degraded"] is False, tenancy


async def test_the_eviction_policy_is_read_again() -> None:
    server, url, port = _redis("noeviction")
    with server:
        store = RedisStore(connect_redis(url), listen=False)
        try:
            await store.start()
            assert store.evicting is None
            redis.Redis(port=port).config_set("maxmemory-policy", "allkeys-lfu")
            await store._say_if_evicting()  # the listener's periodic read
            assert store.evicting is not None and "allkeys-lfu" in store.evicting
            redis.Redis(port=port).config_set("maxmemory-policy", "volatile-lru")
            await store._say_if_evicting()
            assert store.evicting is None
        finally:
            await store.close()
