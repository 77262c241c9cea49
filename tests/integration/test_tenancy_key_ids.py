"""A key record added under a key id, or a key hash, the Redis store already holds (a real
redis-server): refused, never written over the one there. Before, the second record took the
id's entry in the tenant's key index while the first stayed in the keys hash: the first key
still authenticated, but no listing showed it and no revocation by id could reach it (only
deleting its tenant did)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator

import pytest

from gateway.errors import Conflict
from gateway.tenancy import KeyRecord, RedisStore, Tenant, connect_redis, hash_key
from tests.support.procs import redis_proc


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    proc, url = redis_proc()
    with proc:
        yield url


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisStore]:
    store = RedisStore(connect_redis(redis_url, timeout_s=5), namespace=f"t{secrets.token_hex(4)}",
                       listen=False)
    await store.create_tenant(Tenant(id="acme", tier="default"))
    await store.create_tenant(Tenant(id="beta", tier="default"))
    try:
        yield store
    finally:
        await store.close()


def _key(tenant: str, key_id: str, key: str) -> KeyRecord:
    return KeyRecord(key_id=key_id, tenant_id=tenant, key_hash=hash_key(key), created_at=1.0)


async def test_a_key_id_taken_is_refused_and_the_key_under_it_stays_revocable(
    store: RedisStore,
) -> None:
    first = _key("acme", "key_1", "kvg-first")
    await store.add_key(first)
    with pytest.raises(Conflict):
        await store.add_key(_key("acme", "key_1", "kvg-second"))
    assert await store.list_keys("acme") == [first]
    assert await store.revoke_key("acme", "key_1")
    assert (await store.snapshot()).keys == {}  # nothing left that authenticates


async def test_a_key_hash_held_by_another_tenant_is_refused(store: RedisStore) -> None:
    """The same key for a second tenant would move it there, and revoking it from the first
    tenant (its index still names it) would revoke the second tenant's key."""
    first = _key("acme", "key_1", "kvg-same")
    await store.add_key(first)
    with pytest.raises(Conflict):
        await store.add_key(_key("beta", "key_2", "kvg-same"))
    snap = await store.snapshot()
    assert [r.tenant_id for r in snap.keys.values()] == ["acme"]
    assert await store.list_keys("beta") == []
