"""The Redis store finds a tenant's keys in its view (for a revocation, a tenant's deletion, a
listing) through an index by tenant that follows whole reads and the journal's updates: each
revocation scanned every key of the view (~8 ms of gateway CPU at 10,000 keys). What it finds
must stay what a scan finds, a lost key index (``:tkeys:<id>`` evicted or deleted by hand)
included. A real redis-server and the real store."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any, NoReturn

import pytest
import redis.asyncio as aioredis

from gateway.tenancy import RedisStore, Tenant, connect_redis
from gateway.tenancy.keys import generate_key, hash_key, new_key_id
from gateway.tenancy.memory import InMemoryStore
from gateway.tenancy.models import KeyRecord


class _NoScan(dict[str, KeyRecord]):
    """A view of key records that refuses to be walked whole: a look-up by hash is fine."""

    def _refuse(self, *_: Any) -> NoReturn:
        raise AssertionError("every key of the view was scanned")

    def items(self) -> Any:
        self._refuse()

    def values(self) -> Any:
        self._refuse()

    def __iter__(self) -> Iterator[str]:
        self._refuse()


@pytest.fixture
async def pair(redis_url: str) -> AsyncIterator[tuple[RedisStore, RedisStore, aioredis.Redis]]:
    """Two gateways' stores on one namespace (the writer, and one that revokes and deletes
    from its view) and a plain client for writes behind kvgate's back."""
    namespace = f"t{secrets.token_hex(4)}"
    writer = RedisStore(connect_redis(redis_url), namespace=namespace, listen=False)
    other = RedisStore(connect_redis(redis_url), namespace=namespace, listen=False)
    raw = aioredis.from_url(redis_url)
    for tid in ("a", "b"):
        await writer.create_tenant(Tenant(id=tid, tier="default"))
    try:
        yield writer, other, raw
    finally:
        await writer.close()
        await other.close()
        await raw.aclose()


async def _key(store: RedisStore | InMemoryStore, tenant: str) -> tuple[str, str]:
    key, key_id = generate_key(), new_key_id()
    await store.add_key(KeyRecord(key_id=key_id, tenant_id=tenant, key_hash=hash_key(key),
                                  created_at=0.0))
    return hash_key(key), key_id


async def test_a_revocation_reads_only_its_tenants_keys(
        pair: tuple[RedisStore, RedisStore, aioredis.Redis]) -> None:
    writer, other, _ = pair
    ids = [(await _key(writer, tid))[1] for tid in ("a", "a", "b")]
    await other.snapshot()
    other._keys = _NoScan(other._keys)  # a walk of every key now fails the test
    assert await other.revoke_key("a", ids[0])
    assert [r.key_id for r in await other.list_keys("a")] == [ids[1]]
    assert await other.delete_tenant("b")
    assert await writer.list_keys("b") == []


async def test_the_view_by_tenant_follows_the_journal_with_the_index_lost(
        pair: tuple[RedisStore, RedisStore, aioredis.Redis]) -> None:
    """Keys made after `other`'s whole read reach its view through the journal; with the
    tenants' key indexes then deleted by hand, `other` still revokes and deletes them (the
    scripts take the view's hashes), and a revoked key leaves its tenant's view."""
    writer, other, raw = pair
    first = await _key(writer, "a")
    snap = await other.snapshot()
    made = [await _key(writer, tid) for tid in ("a", "a", "b", "b")]
    changed = await other.changes_since(snap.generation)
    assert changed is not None and changed.keys_changed == {h for h, _ in made}
    await raw.delete(f"{other._ns}:tkeys:a", f"{other._ns}:tkeys:b")

    assert await other.revoke_key("a", made[0][1])
    assert not await other.revoke_key("b", made[1][1])  # a's key, asked of b: not found
    changed = await other.changes_since(changed.generation)
    assert changed is not None and made[0][0] not in changed.keys
    assert not await other.revoke_key("a", made[0][1])  # gone from the view as well
    assert {r.key_id for r in await other.list_keys("a")} == {first[1], made[1][1]}

    assert await other.delete_tenant("b")
    left = {h if isinstance(h, str) else h.decode()
            for h in await raw.hkeys(f"{other._ns}:keys")}
    assert left - {"."} == {first[0], made[1][0]}
    changed = await other.changes_since(changed.generation)
    assert changed is not None and "b" not in other._tenant_keys
    assert set(other._tenant_keys["a"]) == {first[0], made[1][0]}


async def test_the_in_memory_store_reads_only_the_tenants_keys() -> None:
    """The in-memory store (one gateway without Redis) likewise: a tenant's deletion and a
    listing walked every key; they read the tenant's own, and stay right."""
    store = InMemoryStore()
    for tid in ("a", "b"):
        await store.create_tenant(Tenant(id=tid, tier="default"))
    made = [await _key(store, tid) for tid in ("a", "a", "b")]
    store._keys = _NoScan(store._keys)  # a walk of every key now fails the test
    assert [r.key_id for r in await store.list_keys("a")] == sorted(
        [made[0][1], made[1][1]], key=lambda kid: (0.0, kid))
    assert await store.revoke_key("a", made[0][1])
    assert not await store.revoke_key("b", made[1][1])  # a's key, asked of b
    assert await store.delete_tenant("b")
    assert not await store.delete_tenant("b")
    assert [r.key_id for r in await store.list_keys("a")] == [made[1][1]]
    assert await store.list_keys("b") == []
    await store.create_tenant(Tenant(id="b", tier="default"))  # made again: no old key
    assert await store.list_keys("b") == []
    assert set(dict(store._keys)) == {made[1][0]}
