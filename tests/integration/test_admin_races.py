"""Admin writes racing each other through two gateways (two admin apps, each with its own
store, on one real redis-server), over real HTTP."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from gateway.admin import AdminToken
from gateway.policy_doc import parse_policy
from gateway.tenancy import InMemoryStore, RedisStore, TenantStore, connect_redis
from tests.integration.test_admin_api import ADMIN_TOKEN, POLICY_DOC, serve_admin
from tests.support.procs import redis_proc

HEADERS = {"authorization": f"Bearer {ADMIN_TOKEN}"}
ROUNDS = 12
WITH_GOLD: dict[str, Any] = {**POLICY_DOC, "tiers": {**POLICY_DOC["tiers"], "gold": {}}}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    proc, url = redis_proc()
    with proc:
        yield url


@asynccontextmanager
async def two_gateways(redis_url: str | None) -> AsyncIterator[list[str]]:
    """Two admin apps on one Redis namespace (None: one in-memory store behind both)."""
    stores: list[TenantStore]
    if redis_url is None:
        stores = [InMemoryStore()] * 2
    else:
        namespace = f"t{secrets.token_hex(4)}"
        stores = [RedisStore(connect_redis(redis_url, timeout_s=5), namespace=namespace)
                  for _ in range(2)]
    await stores[0].put_policy(parse_policy(WITH_GOLD))
    servers = [serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]) for store in stores]
    try:
        yield [await anext(server) for server in servers]
    finally:
        for server in servers:
            await server.aclose()
        for store in {id(s): s for s in stores}.values():
            await store.close()


@pytest.mark.parametrize("store", ["memory", "redis"])
@pytest.mark.parametrize("write", ["create", "patch"])
async def test_a_tier_is_never_removed_from_under_a_tenant_put_in_it_meanwhile(
    store: str, write: str, request: pytest.FixtureRequest
) -> None:
    """A policy without tier `gold` is PUT through one gateway while a tenant is put in
    `gold` through the other. Each write checks the other's object (the PUT: no tenant uses
    a tier it leaves out; the tenant: its tier is in the policy), so one of them must see
    the other's change: before, both checks read the state before either write, and 22 of
    30 rounds left a tenant in a tier the policy lacked (every request of it a 403)."""
    url = request.getfixturevalue("redis_url") if store == "redis" else None
    without = {**POLICY_DOC}
    async with two_gateways(url) as (a, b), httpx.AsyncClient(headers=HEADERS) as c:
        for i in range(ROUNDS):
            tid = f"t{i}"
            assert (await c.put(f"{a}/admin/policy", json=WITH_GOLD)).status_code == 200
            if write == "patch":
                r = await c.post(f"{b}/admin/tenants", json={"id": tid, "tier": "free"})
                assert r.status_code == 201, r.text
                tenant_write = c.patch(f"{b}/admin/tenants/{tid}", json={"tier": "gold"})
            else:
                tenant_write = c.post(f"{b}/admin/tenants", json={"id": tid, "tier": "gold"})
            put, moved = await asyncio.gather(
                c.put(f"{a}/admin/policy", json=without), tenant_write)
            assert put.status_code in (200, 400), put.text
            assert moved.status_code in (200, 201, 400), moved.text
            tiers = (await c.get(f"{a}/admin/policy")).json()["tiers"]
            tier = (await c.get(f"{a}/admin/tenants/{tid}")).json().get("tier")
            assert tier != "gold" or "gold" in tiers, (i, put.text, moved.text)
            assert (put.status_code == 200) != (moved.status_code in (200, 201)), (i, put.text)
