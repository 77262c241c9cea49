"""A gateway started while Redis is full (`maxmemory` reached under `noeviction`) serves the
tenants and keys Redis holds.

A full Redis refuses every command queued in a MULTI, reads included (OOM), and the store's
loads were MULTI/EXEC reads: a gateway started then (a pod rescheduled, one more replica)
loaded nothing and answered every request 503, though Redis held every key and the policy and
answered plain reads; the gateways already running did the same once their state was older
than `max_staleness_s`.
"""

from __future__ import annotations

import httpx
import openai
import redis

from tests.support.gateway import acme_gateway, admin_client, chat_status, wait_for
from tests.support.procs import Proc, sim_proc

ADMIN = "full-redis-admin-token-012345678"


def test_a_gateway_started_on_a_full_redis_serves_its_keys(
    redis_url: str, procs: list[Proc]
) -> None:
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    procs.append(sim.start())
    first, base = acme_gateway(url, redis_url, ADMIN, limits={})
    procs.append(first.start())
    with admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        store = redis.Redis.from_url(redis_url)
        store.config_set("maxmemory-policy", "noeviction")
        store.config_set("maxmemory", "1")  # full from now on: every write refused
        store.close()
        refused = admin.post("/tenants/acme/keys")  # (Redis refuses writes indeed)
        assert refused.status_code == 503 and "OOM" in refused.json()["error"]["message"]

    second, base2 = acme_gateway(url, redis_url, ADMIN, limits={})
    second.ready_url = f"{base2}/healthz"  # (its tenancy is what is looked at below)
    procs.append(second.start())
    client = openai.OpenAI(base_url=f"{base2}/v1", api_key=key, max_retries=0)
    wait_for(lambda: chat_status(client) == 200, timeout=20, what="the key served on a full Redis")
    ready = httpx.get(f"{base2}/readyz", timeout=5)
    tenancy = ready.json()["tenancy"]
    assert ready.status_code == 200 and tenancy["policy_version"] > 0
    assert tenancy["degraded"] is True and "refuses writes" in tenancy["reason"]  # said so
    assert "OOM" in tenancy["reason"]

    store = redis.Redis.from_url(redis_url)
    store.config_set("maxmemory", "0")  # room again: no restart needed
    store.close()

    def recovered() -> bool:
        return httpx.get(f"{base2}/readyz", timeout=5).json()["tenancy"]["degraded"] is False

    wait_for(recovered, timeout=20, what="the store taking writes again")
    with admin_client(base2, ADMIN) as admin:
        assert admin.post("/tenants/acme/keys").status_code == 201
