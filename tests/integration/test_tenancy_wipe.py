"""A wiped Redis (FLUSHALL, a restart without persistence) under running gateways: noticed
through the bootstrap marker, the state a gateway last loaded written back (once, and not
when older than max_staleness_s) or else re-seeded from the configuration, reported (log,
metric, /readyz), and limits stay on."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

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
    StoreSnapshot,
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
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "wipe-admin-token-0123456789"


def test_a_redis_restarted_empty_gets_the_last_state_back_from_the_gateways(
    sim_factory: SimFactory,
) -> None:
    """Redis restarted without persistence under two gateways: its bootstrap marker is gone,
    and one of them writes back the state they all hold in memory (tenants and keys made
    through the admin API included). Every key made through the admin API used to be lost
    (401s for its clients) and /readyz said degraded for ten minutes."""
    proc, redis_url = redis_proc()
    _, sim = sim_factory("--time-scale", "50", model="m")
    proc.start()
    one, base = acme_gateway(sim, redis_url, ADMIN, {"rpm": 3}, tenancy={"poll_interval_s": 0.1})
    two, base2 = acme_gateway(sim, redis_url, ADMIN, {"rpm": 3},
                              tenancy={"poll_interval_s": 0.1})
    with proc, one, two, admin_client(base, ADMIN) as admin:
        resets = "kvgate_tenancy_store_resets_total"
        assert metric_values(base, resets) == {"": 0.0}
        assert metric_values(base, "kvgate_tenancy_store_wiped") == {"": 0.0}
        assert httpx.get(f"{base}/readyz").json()["tenancy"]["store_resets"] == 0
        made = admin.post("/tenants", json={"id": "beta", "tier": "free"})
        assert made.status_code == 201, made.text
        key = admin.post("/tenants/beta/keys").json()["key"]
        clients = [openai.OpenAI(base_url=f"{b}/v1", api_key=key, max_retries=0)
                   for b in (base, base2)]
        wait_for(lambda: chat_status(clients[1]) == 200, what="the key on the second gateway")
        assert chat_status(clients[0]) == 200

        proc.stop()
        proc.start()  # no persistence: the restarted Redis is empty
        for b in (base, base2):
            def noticed(b: str = b) -> bool:
                return metric_values(b, resets) == {"": 1.0}

            def ready(b: str = b) -> bool:  # restored: not degraded (what a probe waits for)
                return not httpx.get(f"{b}/readyz").json()["degraded"]

            wait_for(noticed, what="the wipe noticed")
            wait_for(ready, what="degraded cleared")
            tenancy = httpx.get(f"{b}/readyz").json()["tenancy"]
            assert tenancy["store_resets"] == 1 and tenancy["store_wiped"]
            # its own signal: Redis answers, so a "Redis down" alert must not fire
            assert metric_values(b, "kvgate_redis_up") == {"": 1.0}
            assert metric_values(b, "kvgate_tenancy_store_wiped") == {"": 1.0}
            assert tenancy["policy_version"] >= 1
        # the key made through the admin API works on both gateways, limits in force (rpm 3;
        # the budgets were in the wiped store: they start again)
        assert [chat_status(c) for c in clients] == [200, 200]
        assert [chat_status(clients[0]) for _ in range(2)] == [200, 429]
        assert sorted(t["id"] for t in admin.get("/tenants").json()["data"]) == ["acme", "beta"]
        assert len(admin.get("/tenants/beta").json()["keys"]) == 1
        gold = admin.post("/tenants", json={"id": "intruder", "tier": "gold"})
        assert gold.status_code == 400 and gold.json()["error"]["param"] == "tier"
        logs = one.output() + two.output()
        assert logs.count("restored 2 tenants and 1 keys") == 1, logs
        # the other gateway says who restored it
        assert "another gateway restored" in logs


async def test_with_no_policy_stored_no_tier_is_accepted() -> None:
    """Between a wipe and the re-seed the store has no policy: creating a tenant then must not
    skip the tier check (its requests would run without limits)."""
    async for url in serve_admin(InMemoryStore(), [AdminToken("ops", ADMIN_TOKEN)]):
        headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        async with httpx.AsyncClient(base_url=url, headers=headers) as client:
            made = await client.post("/admin/tenants", json={"id": "acme", "tier": "free"})
            assert made.status_code == 503, made.text  # to retry: not the request's fault
            assert "no policy is stored" in made.json()["error"]["message"]
            assert (await client.get("/admin/tenants/acme")).status_code == 404


async def test_a_wipe_reseeded_by_another_gateway_is_noticed_whatever_the_generation(
    redis_url: str,
) -> None:
    """Gateway A, just started (it loaded nothing, so it has nothing to restore), re-seeds
    the wiped store from its configuration; gateway B must reload even when the generation
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
        await b.start()
        assert b.authenticate(key).tenant_id == "acme"
        before = await stores[0].generation()
        r = redis.asyncio.Redis.from_url(redis_url)
        try:
            await r.flushall()
            await a.start()  # A re-seeds (a wipe it did not see: not counted there)
            assert a.health().loaded and a.health().store_resets == 0
            await r.set("kvgate:gen", before)  # the counter happens to match B's state
        finally:
            await r.aclose()
        assert await b.refresh()
        assert b.health().store_resets == 1
        assert b.health().degraded and "re-issue" in (b.health().reason or "")
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


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@asynccontextmanager
async def _two_gateways_on(
    redis_url: str, clock: Clock | None = None,
) -> AsyncIterator[tuple[list[RedisStore], list[TenantResolver], str, redis.asyncio.Redis]]:
    """Two resolvers, each on its own store client and seeding from the same configuration,
    on a store holding a tenant made through the admin API (salt group rotated) and its key;
    both loaded. Yields (stores, resolvers, the key, a client of the store's Redis); all
    closed at the end."""
    stores = [RedisStore(connect_redis(redis_url), listen=False) for _ in range(2)]
    resolvers = [TenantResolver(s, SaltDeriver(AUTH_SECRET), poll_interval_s=3600,
                                max_staleness_s=10, clock=clock or time.monotonic)
                 for s in stores]
    for store, resolver in zip(stores, resolvers, strict=True):
        async def reseed(store: RedisStore = store) -> None:
            await bootstrap(store, tenants=[Tenant(id="acme", tier="free")], policy=POLICY)
        resolver.reseed_with(reseed)
    await bootstrap(stores[0], tenants=[Tenant(id="acme", tier="free")], policy=POLICY)
    await stores[0].create_tenant(Tenant(id="beta", tier="free", salt_group="g"))
    await stores[0].rotate_salt("beta")
    key = generate_key()
    await stores[0].add_key(KeyRecord(key_id="k1", tenant_id="beta", key_hash=hash_key(key),
                                      created_at=1.0))
    r = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    try:
        for resolver in resolvers:
            await resolver.start()
            assert resolver.authenticate(key).tenant_id == "beta"
        yield stores, resolvers, key, r
    finally:
        await r.aclose()
        for resolver in resolvers:
            await resolver.close()
        for store in stores:
            await store.close()


POLICY = parse_policy({"pools": {"p": {"served_model": "m", "replicas": ["http://x:1"]}},
                       "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}})
RECORDS = ("kvgate:tenants", "kvgate:keys", "kvgate:tkeys:beta", "kvgate:policy",
           "kvgate:salt_groups")


async def test_two_gateways_finding_the_store_wiped_restore_it_once(redis_url: str) -> None:
    """Both find the marker gone at once: exactly one writes its state back (the records as
    they were, the generation not reset), the other reloads what it wrote."""
    async with _two_gateways_on(redis_url) as (stores, resolvers, key, r):
        stored = {name: await r.hgetall(name) for name in RECORDS}
        before = await stores[0].generation()
        salts = [res.authenticate(key).cache_salt for res in resolvers]
        restores: list[bool] = []
        for store in stores:
            async def restore(snap: StoreSnapshot, real: Callable[..., Any] = store.restore
                              ) -> bool:
                restores.append(await real(snap))
                return restores[-1]
            store.restore = restore  # type: ignore[method-assign]
        await r.flushall()
        assert all(await asyncio.gather(*(res.refresh() for res in resolvers)))
        assert restores.count(True) == 1, restores
        assert {name: await r.hgetall(name) for name in RECORDS} == stored
        assert await stores[0].generation() > before
        for resolver, salt in zip(resolvers, salts, strict=True):
            assert resolver.authenticate(key).cache_salt == salt  # the same tenant, same salt
            health = resolver.health()
            assert health.store_resets == 1 and health.store_wiped and not health.degraded


async def test_a_state_older_than_max_staleness_is_not_restored(redis_url: str) -> None:
    """A gateway whose state the store last confirmed longer ago than `max_staleness_s` (cut
    off: it may hold keys revoked since) re-seeds from configuration only, degraded."""
    clock = Clock()
    async with _two_gateways_on(redis_url, clock) as (_stores, resolvers, key, r):
        await r.flushall()
        clock.now += 11  # the store last confirmed their state 11 s ago: max_staleness_s 10
        assert await resolvers[0].refresh()
        assert await r.hget("kvgate:tenants", "beta") is None
        with pytest.raises(AuthError):
            resolvers[0].authenticate(key)
        health = resolvers[0].health()
        assert health.store_resets == 1 and health.degraded
        assert "re-issue" in (health.reason or "")
        assert await r.hget("kvgate:tenants", "acme") is not None  # the configured tenant
