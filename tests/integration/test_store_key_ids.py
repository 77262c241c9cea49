"""A tenant's key ids are unique in both stores: a second key under an id the tenant already
has, or a key hash already stored, is a 409 Conflict with nothing written over (the admin
API then draws another id). Another tenant may have the same key id."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest

from gateway.errors import Conflict
from gateway.tenancy import InMemoryStore, KeyRecord, RedisStore, Tenant, TenantStore, connect_redis


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[TenantStore]:
    s: TenantStore
    if request.param == "memory":
        s = InMemoryStore()
    else:
        url = request.getfixturevalue("redis_url")
        s = RedisStore(connect_redis(url, timeout_s=5), namespace=f"t{secrets.token_hex(4)}")
    await s.start()
    await s.create_tenant(Tenant(id="acme", tier="free"))
    await s.create_tenant(Tenant(id="beta", tier="free"))
    yield s
    await s.close()


def _key(tenant: str, kid: str, key_hash: str) -> KeyRecord:
    return KeyRecord(key_id=kid, tenant_id=tenant, key_hash=key_hash, created_at=1.0)


async def test_a_key_id_the_tenant_has_is_a_conflict(store: TenantStore) -> None:
    first = _key("acme", "k1", "hash-1")
    await store.add_key(first)
    with pytest.raises(Conflict) as caught:
        await store.add_key(_key("acme", "k1", "hash-2"))
    assert caught.value.status == 409
    assert caught.value.message == "key id 'k1' (or the key itself) is already stored"
    assert await store.list_keys("acme") == [first]  # nothing written over, nothing added
    assert set((await store.snapshot()).keys) == {"hash-1"}


async def test_a_key_hash_already_stored_is_a_conflict(store: TenantStore) -> None:
    await store.add_key(_key("acme", "k1", "hash-1"))
    for tenant in ("acme", "beta"):
        with pytest.raises(Conflict):
            await store.add_key(_key(tenant, "k2", "hash-1"))
    assert [k.key_id for k in await store.list_keys("acme")] == ["k1"]
    assert await store.list_keys("beta") == []


async def test_another_tenant_may_have_the_same_key_id(store: TenantStore) -> None:
    await store.add_key(_key("acme", "k1", "hash-1"))
    await store.add_key(_key("beta", "k1", "hash-2"))
    assert set((await store.snapshot()).keys) == {"hash-1", "hash-2"}
