"""A Redis turned read-only under the gateway (a Sentinel or cluster failover left
KVGATE_REDIS_URL on the old primary, now a replica: `REPLICAOF` another server) answers every
read, inside a MULTI too, and refuses every write (READONLY). The store's loads went through,
so /readyz reported nothing while admin writes failed; a full Redis (OOM) was reported. Now a
read-only one is reported the same way, named, until it takes writes again; an admin write
answers a 503 naming the cause; a request is still served. Real redis-server, real gateway,
the openai client."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import openai

from gateway.tenancy import connect_redis
from tests.support.gateway import acme_gateway, admin_client, chat_status, wait_for
from tests.support.procs import Proc, free_port, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "read-only-redis-admin-token-0123"


def _replica_of(url: str, port: int | None) -> None:
    """REPLICAOF a primary that is not there (`port`; None: NO ONE, writable again). A replica
    that never reached its primary keeps its data and serves it (replica-serve-stale-data)."""
    async def go() -> None:
        r = connect_redis(url)
        if port is None:
            await r.replicaof("NO", "ONE")
        else:
            await r.replicaof("127.0.0.1", port)
        await r.aclose()
    asyncio.run(go())


def _tenancy(base: str) -> dict[str, Any]:
    ready: dict[str, Any] = httpx.get(f"{base}/readyz", timeout=5).json()["tenancy"]
    return ready


def test_a_read_only_redis_is_reported_and_admin_writes_say_why(
        sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    redis, url = redis_proc()
    gw, base = acme_gateway(sim, url, ADMIN, {})
    with redis, gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        assert _tenancy(base)["degraded"] is False
        _replica_of(url, free_port())
        wait_for(lambda: _tenancy(base)["degraded"] is True, timeout=20,
                 what="/readyz to report the read-only store")
        reason = _tenancy(base)["reason"]
        assert "refuses writes" in reason and "READONLY" in reason, reason
        refused = admin.post("/tenants/acme/keys")
        assert refused.status_code == 503, refused.text
        assert "READONLY" in refused.json()["error"]["message"]
        assert "read-only replica" in refused.json()["error"]["message"]
        assert chat_status(client) == 200  # its keys are still served
        # the shared routing state's writes (XADD) are refused too: it says so itself
        sync = httpx.get(f"{base}/readyz", timeout=5).json()["sync"]
        assert sync["degraded"] is True and "READONLY" in sync["reason"], sync
        _replica_of(url, None)
        wait_for(lambda: _tenancy(base)["degraded"] is False, timeout=20,
                 what="/readyz to clear once Redis takes writes")
        assert admin.post("/tenants/acme/keys").status_code == 201
        wait_for(lambda: httpx.get(f"{base}/readyz", timeout=5).json()["degraded"] is False,
                 timeout=20, what="the shared routing state to resume")
