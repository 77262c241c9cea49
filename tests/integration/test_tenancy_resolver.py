"""The hot-path cache: authentication, propagation between replicas, salts, policy snapshots."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from gateway.errors import AuthError
from gateway.policy_doc import Limits, parse_policy
from gateway.tenancy import (
    InMemoryStore,
    KeyRecord,
    PolicySnapshot,
    RedisStore,
    SaltDeriver,
    StoreSnapshot,
    Tenant,
    TenantResolver,
    TenantStore,
    connect_redis,
    generate_key,
    hash_key,
    parse_bearer,
)
from tests.support.procs import redis_proc

SECRET = "integration-test-secret-0123456789"
POLICY = parse_policy(
    {
        "pools": {"p": {"served_model": "m-p", "replicas": ["http://127.0.0.1:9"]}},
        "models": {"m": {"default": "p"}},
        "tiers": {"free": {"limits": {"rpm": 60, "tpm": 1000}}, "premium": {}},
    }
)


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[str]:
    proc, url = redis_proc()
    with proc:
        yield url


StoreFactory = Callable[..., TenantStore]


@pytest.fixture(params=["memory", "redis"])
async def stores(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """Stores that see the same state (one per simulated gateway replica)."""
    made: list[TenantStore] = []
    memory = InMemoryStore()
    ns = f"t{secrets.token_hex(4)}"

    def make(listen: bool = True) -> TenantStore:
        if request.param == "memory":
            return memory
        url = request.getfixturevalue("shared_redis")
        store = RedisStore(connect_redis(url), namespace=ns, listen=listen)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


async def _until(cond: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not cond():  # noqa: ASYNC110 - polling a condition with a deadline
            await asyncio.sleep(0.01)


async def _add_key(store: TenantStore, tenant: str) -> tuple[str, str]:
    key, kid = generate_key(), f"key_{secrets.token_hex(3)}"
    await store.add_key(
        KeyRecord(key_id=kid, tenant_id=tenant, key_hash=hash_key(key), created_at=0.0)
    )
    return key, kid


async def _resolver(store: TenantStore, **kw: Any) -> TenantResolver:
    await store.start()
    resolver = TenantResolver(store, SaltDeriver(SECRET), **kw)
    await resolver.start()
    return resolver


async def test_authenticate_and_effective_limits(stores: StoreFactory) -> None:
    store = stores()
    await store.put_policy(POLICY)
    await store.create_tenant(Tenant(id="acme", tier="free", limits=Limits(rpm=5)))
    key, _ = await _add_key(store, "acme")
    resolver = await _resolver(store)
    try:
        p = resolver.authenticate(key)
        assert (p.tenant_id, p.tier) == ("acme", "free")
        assert p.limits == Limits(rpm=5, tpm=1000)  # override + tier default
        assert p.policy is not None and p.policy.version == 1
        assert p.cache_salt == SaltDeriver(SECRET).derive("tenant:acme", 0)
        assert p.cache_salt not in repr(p)
        for bad in (None, "", "kvg-nope", key + "x"):
            with pytest.raises(AuthError):
                resolver.authenticate(bad)
        assert parse_bearer(f"Bearer {key}") == key and parse_bearer("Basic x") is None
        assert not resolver.health().degraded
    finally:
        await resolver.close()


@pytest.mark.parametrize("path", ["pubsub", "poll"])
async def test_changes_reach_another_replica(stores: StoreFactory, path: str) -> None:
    """Revocation, salt rotation and a new policy reach a second replica by pub/sub alone
    (no polling) and by the periodic version check alone (no pub/sub)."""
    admin_side = stores()
    await admin_side.put_policy(POLICY)
    await admin_side.create_tenant(Tenant(id="acme", tier="free"))
    key, kid = await _add_key(admin_side, "acme")
    poll = 3600.0 if path == "pubsub" else 0.1
    replica_store = stores(listen=(path == "pubsub"))
    replica = await _resolver(replica_store, poll_interval_s=poll)
    policies: list[PolicySnapshot] = []
    replica.on_policy(policies.append)
    try:
        old_salt = replica.authenticate(key).cache_salt
        await admin_side.rotate_salt("acme")
        await _until(lambda: replica.authenticate(key).cache_salt != old_salt)
        await admin_side.put_policy(POLICY, if_version=1)
        await _until(lambda: replica.policy is not None and replica.policy.version == 2)
        assert [s.version for s in policies] == [2]
        await admin_side.revoke_key("acme", kid)

        def revoked() -> bool:
            try:
                replica.authenticate(key)
            except AuthError:
                return True
            return False

        await _until(revoked)
    finally:
        await replica.close()


async def test_group_rotation_changes_every_members_salt(stores: StoreFactory) -> None:
    store = stores()
    await store.put_policy(POLICY)
    for tid in ("a", "b"):
        await store.create_tenant(Tenant(id=tid, tier="free", salt_group="public"))
    await store.create_tenant(Tenant(id="c", tier="free"))
    keys = {tid: (await _add_key(store, tid))[0] for tid in ("a", "b", "c")}
    resolver = await _resolver(store)
    try:
        salts = {tid: resolver.authenticate(k).cache_salt for tid, k in keys.items()}
        assert salts["a"] == salts["b"] != salts["c"]
        gen = resolver.health().generation
        await store.rotate_salt("a")
        await _until(lambda: resolver.health().generation > gen)
        after = {tid: resolver.authenticate(k).cache_salt for tid, k in keys.items()}
        assert after["a"] == after["b"] != salts["a"] and after["c"] == salts["c"]
    finally:
        await resolver.close()


class _FlakyStore(InMemoryStore):
    """A store whose snapshots fail once with an unexpected error (an unreadable record)."""

    fail_next = False

    async def snapshot(self) -> StoreSnapshot:
        if self.fail_next:
            self.fail_next = False
            raise ValueError("a record this gateway version cannot read")
        return await super().snapshot()


async def test_an_unreadable_snapshot_degrades_and_sync_goes_on() -> None:
    store = _FlakyStore()
    await store.put_policy(POLICY)
    await store.create_tenant(Tenant(id="acme", tier="free"))
    key, _ = await _add_key(store, "acme")
    resolver = await _resolver(store, poll_interval_s=0.05)
    try:
        store.fail_next = True
        await store.create_tenant(Tenant(id="later", tier="free"))  # a change: a refresh runs
        await _until(lambda: resolver.health().degraded)
        assert resolver.authenticate(key).tenant_id == "acme"  # last known state serves
        late_key, _ = await _add_key(store, "later")  # the next refresh reads fine again
        await _until(lambda: not resolver.health().degraded)
        assert resolver.authenticate(late_key).tenant_id == "later"
    finally:
        await resolver.close()


async def test_a_reload_reuses_what_did_not_change(stores: StoreFactory) -> None:
    """Each admin write reloads the tenancy state (read-your-writes): its cost must not grow
    with every key ever made (2,000 keys one by one took 60 s in memory, 96 s on Redis). A
    tenant's keys share its one principal, and on Redis only changed key records are parsed
    again."""
    store = stores()
    await store.put_policy(POLICY)
    await store.create_tenant(Tenant(id="acme", tier="free"))
    keys = [(await _add_key(store, "acme"))[0] for _ in range(3)]
    resolver = await _resolver(store)
    try:
        first = resolver.authenticate(keys[0])
        assert all(resolver.authenticate(k) is first for k in keys)
        before = (await store.snapshot()).keys
        new_key, _ = await _add_key(store, "acme")
        after = (await store.snapshot()).keys
        assert all(after[h] is record for h, record in before.items())  # not parsed again
        await resolver.refresh()
        assert resolver.authenticate(new_key).tenant_id == "acme"
    finally:
        await resolver.close()


class _HeldMemory(InMemoryStore):
    """Its next read (whole or journal) is made, then held until `release` is set."""

    hold = False
    release = asyncio.Event()

    async def snapshot(self) -> StoreSnapshot:
        return await self._held(await super().snapshot())

    async def _held(self, snap: StoreSnapshot) -> StoreSnapshot:
        if self.hold:
            self.hold = False
            await self.release.wait()
        return snap


class _HeldRedis(RedisStore):
    hold = False
    release = asyncio.Event()

    async def snapshot(self) -> StoreSnapshot:
        return await self._held(await super().snapshot())

    async def changes_since(self, generation: int) -> StoreSnapshot | None:
        snap = await super().changes_since(generation)
        return None if snap is None else await self._held(snap)

    async def _held(self, snap: StoreSnapshot) -> StoreSnapshot:
        if self.hold:
            self.hold = False
            await self.release.wait()
        return snap


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_an_older_read_never_lands_over_a_newer_one(kind: str, shared_redis: str) -> None:
    """A reload that read the store before a write, and is slow to finish, against a reload
    made after the write (an admin write's read-your-writes refresh beside the sync loop's):
    the newer state stays. Refreshes run one at a time, so the later one reads after the older
    one has landed; were they to overlap, the older snapshot would land last and a key revoked
    meanwhile would work again."""
    store: _HeldMemory | _HeldRedis = (
        _HeldMemory() if kind == "memory"
        else _HeldRedis(connect_redis(shared_redis), namespace=f"t{secrets.token_hex(4)}",
                        listen=False))
    store.release = asyncio.Event()
    resolver = TenantResolver(store, SaltDeriver(SECRET), poll_interval_s=3600,
                              max_staleness_s=None)
    try:
        await store.put_policy(POLICY)
        await store.create_tenant(Tenant(id="acme", tier="free"))
        key, kid = await _add_key(store, "acme")
        assert await resolver.refresh()  # loaded (no sync loop: the test orders the reloads)
        await _add_key(store, "acme")  # a write, then a reload of it that is slow to finish
        store.hold = True
        older = asyncio.create_task(resolver.refresh())
        await asyncio.sleep(0.05)
        assert await store.revoke_key("acme", kid)  # a later write, and a reload after it
        newer = asyncio.create_task(resolver.refresh())
        await asyncio.sleep(0.05)
        store.release.set()
        assert await older and await newer
        assert resolver.health().generation == await store.generation()
        with pytest.raises(AuthError):
            resolver.authenticate(key)  # revoked: the older read did not bring it back
    finally:
        await store.close()
