"""A wiped Redis (FLUSHALL) under a running gateway: noticed through the bootstrap marker,
re-seeded from the configuration, reported (log, metric, /readyz), and limits stay on."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest
import redis
import redis.asyncio

from gateway.admin import AdminToken
from gateway.errors import AuthError
from gateway.policy_doc import parse_policy
from gateway.tenancy import (
    InMemoryStore,
    KeyRecord,
    RedisStore,
    SaltDeriver,
    Tenant,
    TenantResolver,
    bootstrap,
    connect_redis,
    generate_key,
    hash_key,
)
from tests.integration.test_admin_api import ADMIN_TOKEN, serve_admin
from tests.support.gateway import (
    AUTH_SECRET,
    acme_gateway,
    admin_client,
    chat_status,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "wipe-admin-token-0123456789"


def test_flushall_is_noticed_and_the_store_reseeded_from_config(
    sim_factory: SimFactory, redis_url: str
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    gw, base = acme_gateway(sim, redis_url, ADMIN, {"rpm": 3}, tenancy={"poll_interval_s": 0.1})
    with gw, admin_client(base, ADMIN) as admin:
        resets = "kvgate_tenancy_store_resets_total"
        assert metric_values(base, resets) == {"": 0.0}
        assert metric_values(base, "kvgate_tenancy_store_wiped") == {"": 0.0}
        assert httpx.get(f"{base}/readyz").json()["tenancy"]["store_resets"] == 0
        old_key = admin.post("/tenants/acme/keys").json()["key"]
        assert chat_status(openai.OpenAI(base_url=f"{base}/v1", api_key=old_key, max_retries=0)) \
            == 200

        r = redis.Redis.from_url(redis_url)
        try:
            r.flushall()
        finally:
            r.close()
        wait_for(lambda: metric_values(base, resets) == {"": 1.0}, what="the wipe noticed")

        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 200 and ready.json()["tenancy"]["store_resets"] == 1
        # serving, but its clients' keys are gone: said where operators look, not only logged
        tenancy = ready.json()["tenancy"]
        assert ready.json()["degraded"] and tenancy["degraded"]
        assert "wiped" in tenancy["reason"] and "re-issue" in tenancy["reason"]
        # its own signal: Redis answers, so a "Redis down" alert must not fire for ten minutes
        assert metric_values(base, "kvgate_redis_up") == {"": 1.0}
        assert metric_values(base, "kvgate_tenancy_store_wiped") == {"": 1.0}
        assert ready.json()["tenancy"]["policy_version"] >= 1
        assert metric_values(base, "kvgate_policy_version")[""] >= 1
        assert "wiped" in gw.output()
        # the policy and the configured tenant are back; unknown tiers are refused again
        assert admin.get("/policy").status_code == 200
        assert [t["id"] for t in admin.get("/tenants").json()["data"]] == ["acme"]
        gold = admin.post("/tenants", json={"id": "intruder", "tier": "gold"})
        assert gold.status_code == 400 and gold.json()["error"]["param"] == "tier"
        # keys were in the wiped store: gone (an operator re-issues them)
        wait_for(lambda: chat_status(openai.OpenAI(base_url=f"{base}/v1", api_key=old_key,
                                               max_retries=0)) == 401, what="old keys gone")
        # a new key: the tier's limits are in force again (rpm 3), not silently off
        key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        wait_for(lambda: chat_status(client) == 200, what="the new key")
        statuses = [chat_status(client) for _ in range(4)]
        assert statuses.count(200) == 2 and statuses[-1] == 429, statuses
        audit = admin.get("/audit").json()["data"]
        assert any(e["action"] == "key.create" for e in audit)


async def test_with_no_policy_stored_no_tier_is_accepted() -> None:
    """Between a wipe and the re-seed the store has no policy: creating a tenant then must not
    skip the tier check (its requests would run without limits)."""
    async for url in serve_admin(InMemoryStore(), [AdminToken("ops", ADMIN_TOKEN)]):
        headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(base_url=url, headers=headers) as client:
            made = await client.post("/admin/tenants", json={"id": "acme", "tier": "free"})
            assert made.status_code == 400, made.text
            assert made.json()["error"]["param"] == "tier"


async def test_a_wipe_reseeded_by_another_gateway_is_noticed_whatever_the_generation(
    redis_url: str,
) -> None:
    """Gateway A re-seeds the wiped store; gateway B must reload even when the generation
    counter happens to read as before (it is the marker, not the counter, that tells)."""
    policy = parse_policy({"pools": {"p": {"served_model": "m", "replicas": ["http://x:1"]}},
                           "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}})
    tenants = [Tenant(id="acme", tier="free")]
    stores = [RedisStore(connect_redis(redis_url), listen=False) for _ in range(2)]
    a, b = (TenantResolver(s, SaltDeriver(AUTH_SECRET), poll_interval_s=3600) for s in stores)

    async def reseed_a() -> None:
        await bootstrap(stores[0], tenants=tenants, policy=policy)

    async def reseed_b() -> None:
        await bootstrap(stores[1], tenants=tenants, policy=policy)

    a.reseed_with(reseed_a)
    b.reseed_with(reseed_b)
    try:
        await bootstrap(stores[0], tenants=tenants, policy=policy)
        key = generate_key()
        await stores[0].add_key(KeyRecord(key_id="k", tenant_id="acme", key_hash=hash_key(key),
                                          created_at=0.0))
        await a.start()
        await b.start()
        assert b.authenticate(key).tenant_id == "acme"
        before = await stores[0].generation()
        r = redis.asyncio.Redis.from_url(redis_url)
        try:
            await r.flushall()
            assert await a.refresh() and a.health().store_resets == 1  # A re-seeds
            await r.set("kvgate:gen", before)  # the counter happens to match B's state
        finally:
            await r.aclose()
        assert await b.refresh()
        assert b.health().store_resets == 1
        with pytest.raises(AuthError):  # B reloaded: the wiped key is gone there too
            b.authenticate(key)
    finally:
        for resolver in (a, b):
            await resolver.close()
        for store in stores:
            await store.close()


def test_a_policy_lost_from_a_store_that_kept_the_rest_is_written_back(
    sim_factory: SimFactory, redis_url: str
) -> None:
    """Only the policy's key gone (deleted by hand, or evicted by an `allkeys-*` Redis): the
    marker is there, so this is no wipe. Every request used to get 403 (no tier defined), with
    /readyz saying all was well and the admin API refusing every tier ("no policy is stored
    yet") until someone put a policy back. The policy in force, an operator's change included,
    is written back and the gateway keeps serving."""
    _, sim = sim_factory("--time-scale", "50", model="m")
    gw, base = acme_gateway(sim, redis_url, ADMIN, {"rpm": 100}, tenancy={"poll_interval_s": 0.1})
    with gw, admin_client(base, ADMIN) as admin:
        client = openai.OpenAI(base_url=f"{base}/v1", max_retries=0,
                               api_key=admin.post("/tenants/acme/keys").json()["key"])
        changed = admin.patch("/policy", json={"tiers": {"free": {"limits": {"rpm": 77}}}})
        assert changed.status_code == 200, changed.text
        r = redis.Redis.from_url(redis_url)
        try:
            assert r.delete("kvgate:policy") == 1
        finally:
            r.close()
        # a write (the generation moves: the gateway reloads at once) finds it gone
        assert admin.patch("/tenants/acme", json={"limits": {"rpm": 100}}).status_code == 200
        wait_for(lambda: admin.get("/policy").status_code == 200, what="the policy written back")
        assert admin.get("/policy").json()["tiers"]["free"]["limits"]["rpm"] == 77
        assert chat_status(client) == 200
        assert admin.post("/tenants", json={"id": "later", "tier": "free"}).status_code == 201
        assert "lost its policy" in gw.output()
