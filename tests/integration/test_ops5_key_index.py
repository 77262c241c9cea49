"""A reload after an admin write updates the resolver's index of API keys where the journal
says keys changed, instead of making it anew: a step per key at every write made creating
10,000 keys through the admin API slow down from ~5 to ~35 ms a key (measured on a loaded
2-core machine; 14 of 37 s of a gateway's time in the rebuild). What the index answers must
stay what a whole rebuild answers: keys created, revoked, a tenant deleted with its keys, a
tenant's tier changed, a salt rotated. A real redis-server and the real store."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest

from gateway.errors import AuthError, Conflict
from gateway.policy_doc import parse_policy
from gateway.tenancy import RedisStore, SaltDeriver, Tenant, TenantResolver, connect_redis
from gateway.tenancy.keys import generate_key, hash_key, new_key_id
from gateway.tenancy.memory import InMemoryStore
from gateway.tenancy.models import KeyRecord

SECRET = "ops5-key-index-secret-0123456789abcdef"
DOC = {"pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
       "models": {"m": {"default": "p", "free": "p"}}, "tiers": {"free": {"limits": {"rpm": 60}}}}


@pytest.fixture
async def stores(redis_url: str) -> AsyncIterator[tuple[RedisStore, TenantResolver,
                                                         TenantResolver]]:
    """The store written to, its resolver, and a resolver reading it whole each time through
    a store of its own (a store keeps the view its resolver reads the journal against)."""
    namespace = f"t{secrets.token_hex(4)}"
    store = RedisStore(connect_redis(redis_url, timeout_s=5), namespace=namespace, listen=False)
    other = RedisStore(connect_redis(redis_url, timeout_s=5), namespace=namespace, listen=False)
    await store.put_policy(parse_policy(DOC))
    for tid in ("a", "b", "c"):
        await store.create_tenant(Tenant(id=tid, tier="free"))
    found = TenantResolver(store, SaltDeriver(SECRET))
    assert await found.refresh()
    try:
        yield store, found, TenantResolver(other, SaltDeriver(SECRET))
    finally:
        await store.close()
        await other.close()


async def _key(store: RedisStore | InMemoryStore, tenant: str) -> tuple[str, str]:
    key, key_id = generate_key(), new_key_id()
    await store.add_key(KeyRecord(key_id=key_id, tenant_id=tenant, key_hash=hash_key(key),
                                  created_at=0.0))
    return key, key_id


def _updated_in_place(found: TenantResolver) -> None:
    """The last reload read the journal and updated the key index where keys changed."""
    applied = found._applied
    assert applied is not None and applied.keys_from is not None and applied.keys_changed


def _who(found: TenantResolver, key: str) -> str | None:
    try:
        return found.authenticate(key).tenant_id
    except AuthError:
        return None


async def _same_as_rebuilt(found: TenantResolver, whole: TenantResolver,
                           keys: dict[str, str]) -> None:
    """`found` (reloaded from the journal) answers each key as one read whole does."""
    assert await found.refresh()
    fresh = TenantResolver(whole._store, SaltDeriver(SECRET))
    assert await fresh.refresh()
    for key in keys:
        assert _who(found, key) == _who(fresh, key) == (keys[key] or None), key
        if keys[key]:
            assert found.authenticate(key) == fresh.authenticate(key)
    for tid in ("a", "b", "c"):
        assert found.has_keys(tid) == fresh.has_keys(tid), tid


async def test_the_key_index_follows_each_write(
        stores: tuple[RedisStore, TenantResolver, TenantResolver]) -> None:
    store, found, whole = stores
    keys: dict[str, str] = {}
    ids: dict[str, str] = {}
    for tenant in ("a", "a", "b", "c"):
        key, key_id = await _key(store, tenant)
        keys[key], ids[key] = tenant, key_id
        await _same_as_rebuilt(found, whole, keys)
        _updated_in_place(found)
    revoked = next(k for k, t in keys.items() if t == "b")
    assert await store.revoke_key("b", ids[revoked])
    keys[revoked] = ""  # refused now; b has no key left
    await _same_as_rebuilt(found, whole, keys)
    _updated_in_place(found)
    assert not found.has_keys("b")

    await store.update_tenant("a", {"tier": "default"})  # a's principal made anew
    await _same_as_rebuilt(found, whole, keys)
    assert {found.authenticate(k).tier for k, t in keys.items() if t == "a"} == {"default"}
    key, ids[key] = await _key(store, "a")  # then a key write again
    keys[key] = "a"
    await _same_as_rebuilt(found, whole, keys)

    await store.rotate_salt("c")
    await _same_as_rebuilt(found, whole, keys)
    await store.delete_tenant("c")
    keys.update({k: "" for k, t in keys.items() if t == "c"})
    await _same_as_rebuilt(found, whole, keys)
    assert not found.has_keys("c")


async def test_the_in_memory_store_key_index_follows_each_write() -> None:
    """The same with the in-memory store (one gateway without Redis), which also found a key's
    id among every key by a scan at each creation and revocation."""
    store = InMemoryStore()
    await store.put_policy(parse_policy(DOC))
    for tid in ("a", "b"):
        await store.create_tenant(Tenant(id=tid, tier="free"))
    found = TenantResolver(store, SaltDeriver(SECRET))
    assert await found.refresh()
    keys: dict[str, str] = {}
    ids: dict[str, str] = {}

    async def check() -> None:
        assert await found.refresh()
        assert {k: _who(found, k) for k in keys} == {k: t or None for k, t in keys.items()}
        assert [found.has_keys(t) for t in ("a", "b")] == [
            "a" in keys.values(), "b" in keys.values()]

    for tenant in ("a", "b", "b"):
        key, ids[key] = await _key(store, tenant)
        keys[key] = tenant
        await check()
        _updated_in_place(found)
    first_b = next(k for k, t in keys.items() if t == "b")
    assert await store.revoke_key("b", ids[first_b])
    assert not await store.revoke_key("b", ids[first_b])  # gone already
    keys[first_b] = ""
    await check()
    _updated_in_place(found)
    with pytest.raises(Conflict):  # a key id the tenant has: refused, as by Redis
        await store.add_key(KeyRecord(key_id=ids[next(iter(keys))], tenant_id="a",
                                      key_hash=hash_key(generate_key()), created_at=0.0))
    assert await store.delete_tenant("b")
    keys.update({k: "" for k, t in keys.items() if t == "b"})
    await check()
    assert [r.key_id for r in await store.list_keys("a")] == [ids[next(iter(keys))]]
