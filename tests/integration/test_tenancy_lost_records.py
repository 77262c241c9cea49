"""A store that kept its bootstrap marker but lost its tenants hash or its keys hash (deleted
by hand, or evicted by a Redis running an `allkeys-*` eviction policy): not a wipe. Every key
used to get 401 from the next whole reload on while /readyz said all was well; the records in
force are written back (by one gateway of two), and an operator's deletion is never undone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import redis.asyncio

from gateway.admin import AdminToken
from gateway.errors import AuthError
from gateway.tenancy import (
    RedisStore,
    SaltDeriver,
    StoreSnapshot,
    Tenant,
    TenantResolver,
    bootstrap,
    connect_redis,
)
from gateway.tenancy.keys import generate_key, hash_key
from gateway.tenancy.models import KeyRecord
from gateway.tenancy.redis_scripts import JOURNAL_CAP
from gateway.tenancy.redis_store import PRESENT
from gateway.tenancy.resolver import WHOLE_RELOAD_S
from tests.integration.test_admin_api import ADMIN_TOKEN, serve_admin
from tests.integration.test_tenancy_wipe import POLICY, Clock
from tests.support.gateway import AUTH_SECRET


@asynccontextmanager
async def two_gateways(redis_url: str) -> AsyncIterator[
        tuple[list[TenantResolver], httpx.AsyncClient, list[int | None], Clock]]:
    """Two resolvers, each on its own store client, the admin API on the first store; every
    `restore_lost` answer is recorded. The clock moves only when a test moves it."""
    clock = Clock()
    stores = [RedisStore(connect_redis(redis_url, timeout_s=5.0), listen=False)
              for _ in range(2)]
    resolvers = [TenantResolver(s, SaltDeriver(AUTH_SECRET), poll_interval_s=3600, clock=clock)
                 for s in stores]
    written: list[int | None] = []
    for store, resolver in zip(stores, resolvers, strict=True):
        async def reseed(store: RedisStore = store) -> None:
            await bootstrap(store, tenants=[Tenant(id="acme", tier="free")], policy=POLICY)
        resolver.reseed_with(reseed)

        async def restore_lost(kind: str, snap: StoreSnapshot,
                               real: Callable[..., Any] = store.restore_lost) -> int | None:
            written.append(await real(kind, snap))
            return written[-1]
        store.restore_lost = restore_lost  # type: ignore[method-assign]
    await bootstrap(stores[0], tenants=[Tenant(id="acme", tier="free")], policy=POLICY)
    try:
        async for url in serve_admin(stores[0], [AdminToken("ops", ADMIN_TOKEN)]):
            headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
            async with httpx.AsyncClient(base_url=f"{url}/admin", headers=headers) as admin:
                yield resolvers, admin, written, clock
    finally:
        for resolver in resolvers:
            await resolver.close()
        for store in stores:
            await store.close()


async def make_key(admin: httpx.AsyncClient, tenant_id: str) -> str:
    if tenant_id != "acme":
        made = await admin.post("/tenants", json={"id": tenant_id, "tier": "free"})
        assert made.status_code == 201, made.text
    answer = await admin.post(f"/tenants/{tenant_id}/keys")
    assert answer.status_code == 201, answer.text
    key: str = answer.json()["key"]
    return key


async def reload_whole(resolvers: list[TenantResolver], clock: Clock) -> None:
    """The next reload of each, a whole read (as every `WHOLE_RELOAD_S` even with no write)."""
    clock.now += WHOLE_RELOAD_S + 1
    assert all(await asyncio.gather(*(res.refresh() for res in resolvers)))


@pytest.mark.parametrize("lost", ["kvgate:keys", "kvgate:tenants"])
async def test_a_lost_hash_is_written_back_by_one_gateway(
    redis_url: str, lost: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with two_gateways(redis_url) as (resolvers, admin, written, clock):
        key = await make_key(admin, "beta")
        for resolver in resolvers:
            await resolver.start()
            assert resolver.authenticate(key).tenant_id == "beta"
        async with redis.asyncio.Redis.from_url(redis_url, decode_responses=True) as r:
            stored = await r.hgetall(lost)
            assert await r.delete(lost) == 1
            assert await r.exists("kvgate:seeded")  # the marker stayed: no wipe
            with caplog.at_level(logging.ERROR, logger="gateway.tenancy.resolver"):
                await reload_whole(resolvers, clock)
            for resolver in resolvers:  # was AuthError (401)
                assert resolver.authenticate(key).tenant_id == "beta"
                assert resolver.health().store_resets == 0
            assert await r.hgetall(lost) == stored
        assert sorted(n or 0 for n in written)[-1] == (2 if lost == "kvgate:tenants" else 1)
        assert [n for n in written if n], written  # one gateway wrote back, the other found it
        assert len([n for n in written if n]) == 1, written
        assert caplog.text.count("tenancy store lost its") == 1, caplog.text


async def test_an_operators_deletions_are_not_undone(redis_url: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The keys hash lost, then a tenant deleted through the admin API: the other tenants' keys
    are written back, not the deleted tenant's. Every tenant deleted through the admin API
    (the tenants hash gone, legitimately): nothing comes back."""
    async with two_gateways(redis_url) as (resolvers, admin, written, clock):
        keys = {tid: await make_key(admin, tid) for tid in ("acme", "beta")}
        for resolver in resolvers:
            await resolver.start()
        async with redis.asyncio.Redis.from_url(redis_url, decode_responses=True) as r:
            assert await r.delete("kvgate:keys") == 1
            assert (await admin.delete("/tenants/beta")).status_code == 204
            with caplog.at_level(logging.ERROR, logger="gateway.tenancy.resolver"):
                await reload_whole(resolvers, clock)
            assert sorted(await r.hkeys("kvgate:tenants")) == [PRESENT, "acme"]
            for resolver in resolvers:
                assert resolver.authenticate(keys["acme"]).tenant_id == "acme"
                with pytest.raises(AuthError):
                    resolver.authenticate(keys["beta"])
            assert len(await r.hkeys("kvgate:keys")) == 2  # acme's key and PRESENT
            assert not await r.exists("kvgate:tkeys:beta")
            assert caplog.text.count("wrote back 1 of the state in force") == 1, caplog.text

            caplog.clear()
            written.clear()
            assert (await admin.delete("/tenants/acme")).status_code == 204
            with caplog.at_level(logging.ERROR, logger="gateway.tenancy.resolver"):
                await reload_whole(resolvers, clock)
            # the last record deleted leaves the hash with its PRESENT field: none was lost
            assert await r.hkeys("kvgate:tenants") == await r.hkeys("kvgate:keys") == [PRESENT]
            assert written and not any(written), written
            for resolver in resolvers:
                with pytest.raises(AuthError):
                    resolver.authenticate(keys["acme"])
            assert "lost its" not in caplog.text


async def test_a_store_seeded_before_the_field_gets_it_and_a_revoke_by_hand_stays(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store seeded by a kvgate that kept no `PRESENT` field: the next gateway's start adds
    it to the hashes there, so removing the last key record by hand (a revoke without the
    admin API) leaves the hash and is not taken for a loss (the key would come back)."""
    async with two_gateways(redis_url) as (resolvers, admin, written, clock):
        key = await make_key(admin, "acme")
        async with redis.asyncio.Redis.from_url(redis_url, decode_responses=True) as r:
            await r.hdel("kvgate:tenants", PRESENT)
            await r.hdel("kvgate:keys", PRESENT)  # the old layout: one key record left
            assert await r.delete("kvgate:present") == 1  # (nor the flag that it is kept)
            for resolver in resolvers:
                await resolver.start()
                assert resolver.authenticate(key).tenant_id == "acme"
            await bootstrap(RedisStore(r, listen=False), tenants=[], policy=None)  # a start
            assert PRESENT in await r.hkeys("kvgate:keys")
            (key_hash,) = [h for h in await r.hkeys("kvgate:keys") if h != PRESENT]
            assert await r.hdel("kvgate:keys", key_hash) == 1  # revoked by hand
            with caplog.at_level(logging.ERROR, logger="gateway.tenancy.resolver"):
                await reload_whole(resolvers, clock)
            for resolver in resolvers:
                with pytest.raises(AuthError):
                    resolver.authenticate(key)
            assert await r.hkeys("kvgate:keys") == [PRESENT]
            assert "lost its" not in caplog.text
            assert not any(written), written


async def test_a_gateway_starting_does_not_hide_a_lost_hash(redis_url: str) -> None:
    """A gateway (re)started while the keys hash is lost must not create it empty (that would
    read as every key revoked): the running gateways still write the records back."""
    async with two_gateways(redis_url) as (resolvers, admin, written, clock):
        key = await make_key(admin, "beta")
        for resolver in resolvers:
            await resolver.start()
        async with redis.asyncio.Redis.from_url(redis_url, decode_responses=True) as r:
            assert await r.delete("kvgate:keys") == 1
            await bootstrap(RedisStore(r, listen=False),
                            tenants=[Tenant(id="acme", tier="free")], policy=POLICY)
            assert not await r.exists("kvgate:keys")
            await reload_whole(resolvers, clock)
            for resolver in resolvers:
                assert resolver.authenticate(key).tenant_id == "beta"
            assert len([n for n in written if n]) == 1, written


async def test_the_present_field_is_no_tenant(redis_url: str) -> None:
    async with two_gateways(redis_url) as (_resolvers, admin, _written, _clock):
        async with redis.asyncio.Redis.from_url(redis_url, decode_responses=True) as r:
            for method, path in (("GET", "/tenants/%2E"), ("DELETE", "/tenants/%2E"),
                                 ("PATCH", "/tenants/%2E"), ("POST", "/tenants/%2E/keys")):
                answer = await admin.request(method, path, json={"tier": "free"})
                assert answer.status_code in (400, 404), (method, path, answer.text)
            assert PRESENT in await r.hkeys("kvgate:tenants")
        listed = (await admin.get("/tenants")).json()
        assert [t["id"] for t in listed["data"]] == ["acme"]


async def test_a_hash_made_again_by_a_start_or_a_write_is_still_lost(redis_url: str) -> None:
    """A lost hash made again before the gateways' next whole reload -- by a gateway's start
    (its configured tenants seeded) or by an admin write (a key created) -- holds only the
    new records and no `PRESENT` field: the records in force are still written back (every
    other tenant, every other key, used to be gone for good: 401), the new ones kept, and a
    key written back can be revoked through the admin API."""
    async with two_gateways(redis_url) as (resolvers, admin, written, clock):
        key = await make_key(admin, "beta")
        for resolver in resolvers:
            await resolver.start()
        async with redis.asyncio.Redis.from_url(redis_url, decode_responses=True) as r:
            assert await r.delete("kvgate:tenants", "kvgate:keys") == 2
            await bootstrap(RedisStore(r, listen=False),  # a gateway (re)starting
                            tenants=[Tenant(id="acme", tier="free")], policy=POLICY)
            new_key = await make_key(admin, "acme")  # an admin write: the keys hash again
            assert await r.hkeys("kvgate:tenants") == ["acme"]
            await reload_whole(resolvers, clock)
            for resolver in resolvers:  # was AuthError: beta and its key gone for good
                assert resolver.authenticate(key).tenant_id == "beta"
                assert resolver.authenticate(new_key).tenant_id == "acme"
            assert PRESENT in await r.hkeys("kvgate:tenants")
            assert PRESENT in await r.hkeys("kvgate:keys")
            assert len([n for n in written if n]) == 2, written  # tenants once, keys once
            (listed,) = (await admin.get("/tenants/beta")).json()["keys"]
            assert (await admin.delete(f"/tenants/beta/keys/{listed['id']}")).status_code == 204
            await reload_whole(resolvers, clock)
            for resolver in resolvers:
                with pytest.raises(AuthError):
                    resolver.authenticate(key)


async def test_a_deletion_partly_trimmed_from_the_journal_is_not_undone(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A tenant deleted with more keys than the journal keeps journals an entry per key at
    one generation, and the oldest are trimmed away: the journal cannot tell which keys that
    deletion removed, so nothing is written back (its keys came back, and a tenant created
    again under its id would have had them). Said once by each gateway, not at every whole
    reload while the hash is made again (a key created since: written back with it)."""
    async with two_gateways(redis_url) as (resolvers, admin, written, clock):
        first = await make_key(admin, "big")
        # 1,024 writes in a row: a generous timeout, so one stall of a loaded machine longer
        # than the default 0.5 s does not fail the seeding (CI saw it once)
        store = RedisStore(connect_redis(redis_url, timeout_s=10.0), listen=False)
        try:
            for i in range(JOURNAL_CAP):
                await store.add_key(KeyRecord(key_id=f"k{i}", tenant_id="big",
                                              key_hash=hash_key(generate_key()), created_at=0.0))
        finally:
            await store.close()
        await make_key(admin, "acme")
        for resolver in resolvers:
            await resolver.start()
            assert resolver.authenticate(first).tenant_id == "big"
        async with redis.asyncio.Redis.from_url(redis_url, decode_responses=True) as r:
            assert await r.delete("kvgate:keys") == 1
            assert (await admin.delete("/tenants/big")).status_code == 204
            assert await r.llen("kvgate:journal") == JOURNAL_CAP  # some of its keys trimmed
            with caplog.at_level(logging.ERROR, logger="gateway.tenancy.resolver"):
                await reload_whole(resolvers, clock)
            assert not await r.exists("kvgate:tkeys:big")
            big = [h for h, v in (await r.hgetall("kvgate:keys")).items()
                   if h != PRESENT and '"big"' in v]
            assert big == []
            assert (await admin.post("/tenants", json={"id": "big", "tier": "free"})
                    ).status_code == 201
            made = await admin.post("/tenants/big/keys")
            assert made.status_code == 201, made.text
            new_key = made.json()["key"]
            with caplog.at_level(logging.ERROR, logger="gateway.tenancy.resolver"):
                for _ in range(3):
                    await reload_whole(resolvers, clock)
            for resolver in resolvers:
                with pytest.raises(AuthError):
                    resolver.authenticate(first)
                assert resolver.authenticate(new_key).tenant_id == "big"
            assert None in written, written  # the journal could not tell
            assert caplog.text.count("journal cannot tell") == 2, caplog.text


async def test_a_stale_gateway_does_not_write_back_a_key_revoked_by_hand(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A key record removed by hand (a documented revoke) is not journaled: a gateway cut
    off from the store since (its state last read whole long ago) still holds it, and must
    not be the one that writes a lost keys hash back (the revoked key worked again on every
    gateway); a gateway that read the store whole since does, without it."""
    async with two_gateways(redis_url) as (resolvers, admin, written, clock):
        revoked, kept = await make_key(admin, "acme"), await make_key(admin, "beta")
        for resolver in resolvers:
            await resolver.start()
        fresh, stale = resolvers
        async with redis.asyncio.Redis.from_url(redis_url, decode_responses=True) as r:
            records = await r.hgetall("kvgate:keys")
            (gone,) = [h for h, v in records.items() if '"acme"' in v]
            assert await r.hdel("kvgate:keys", gone) == 1  # revoked by hand
            clock.now += 600  # the stale one: no load meanwhile (cut off)
            assert await fresh.refresh()
            with pytest.raises(AuthError):
                fresh.authenticate(revoked)
            assert await r.delete("kvgate:keys") == 1
            with caplog.at_level(logging.ERROR, logger="gateway.tenancy.resolver"):
                await stale.refresh()  # first to find the hash lost
                await reload_whole(resolvers, clock)
            await reload_whole(resolvers, clock)  # the stale one reads what the other wrote
            for resolver in resolvers:
                with pytest.raises(AuthError):  # was: valid again
                    resolver.authenticate(revoked)
                assert resolver.authenticate(kept).tenant_id == "beta"
            assert len([n for n in written if n]) == 1, written
            assert "read whole 6" in caplog.text, caplog.text
