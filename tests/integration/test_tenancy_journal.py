"""A reload after a write reads what the write changed, not every key record (the journal,
`RedisStore.changes_since`), on a real redis-server: the bytes Redis sends for it do not grow
with the keys stored, and the state it builds is the one a whole read builds, through key
creation, revocation, a tenant deleted and made again under its id, salt rotations and policy
changes; anything the journal does not account for is read whole."""

from __future__ import annotations

import pytest
import redis

from gateway.errors import AuthError
from gateway.policy_doc import parse_policy
from gateway.tenancy import (
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
from gateway.tenancy.resolver import WHOLE_RELOAD_S
from tests.support.gateway import AUTH_SECRET

POLICY = {"pools": {"p": {"served_model": "m", "replicas": ["http://x:1"]}},
          "models": {"llama": {"free": "p", "gold": "p"}},
          "tiers": {"free": {"limits": {"rpm": 5}}, "gold": {}}}
MANY = 3000


def _sent_bytes(r: redis.Redis) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def _view(resolver: TenantResolver, keys: dict[str, str]) -> dict[str, object]:
    """What each key authenticates as (tenant, tier, limits, salt), or the refusal."""
    out: dict[str, object] = {}
    for name, key in keys.items():
        try:
            p = resolver.authenticate(key)
            out[name] = (p.tenant_id, p.tier, p.limits, p.cache_salt)
        except AuthError:
            out[name] = "401"
    return out


async def test_a_reload_after_a_write_reads_what_changed(redis_url: str) -> None:
    salts = SaltDeriver(AUTH_SECRET)
    store = RedisStore(connect_redis(redis_url), listen=False)
    resolver = TenantResolver(store, salts, poll_interval_s=3600, max_staleness_s=None)
    r = redis.Redis.from_url(redis_url)
    keys: dict[str, str] = {}

    async def add(name: str, tenant: str) -> None:
        keys[name] = generate_key()
        await store.add_key(KeyRecord(key_id=name, tenant_id=tenant,
                                      key_hash=hash_key(keys[name]), created_at=0.0))

    async def agrees() -> None:
        """The journal-fed resolver holds what a whole read gives a fresh one."""
        assert await resolver.refresh()
        fresh_store = RedisStore(connect_redis(redis_url), listen=False)
        fresh = TenantResolver(fresh_store, salts, poll_interval_s=3600, max_staleness_s=None)
        try:
            await fresh.start()
            assert _view(resolver, keys) == _view(fresh, keys)
            assert resolver.policy == fresh.policy
            assert resolver.health().generation == fresh.health().generation
        finally:
            await fresh.close()
            await fresh_store.close()

    try:
        await bootstrap(store, policy=parse_policy(POLICY), tenants=[
            Tenant(id="acme", tier="free"), Tenant(id="g1", tier="free", salt_group="pub")])
        pipe = r.pipeline()
        for i in range(MANY):  # many keys already stored (the journal is not what is tested)
            record = KeyRecord(key_id=f"bulk{i}", tenant_id="acme",
                               key_hash=hash_key(f"bulk-key-{i}"), created_at=0.0)
            pipe.hset("kvgate:keys", record.key_hash, record.model_dump_json())
        pipe.incr("kvgate:gen")
        pipe.execute()
        await resolver.start()
        whole = _sent_bytes(r)
        assert await store.snapshot()
        whole = _sent_bytes(r) - whole
        assert whole > MANY * 100, whole  # a whole read sends every key record

        await add("a1", "acme")
        before = _sent_bytes(r)
        assert await resolver.refresh()
        after_write = _sent_bytes(r) - before
        assert after_write < 4000, (after_write, whole)  # not every key record again
        resolver.authenticate(keys["a1"])

        await add("a2", "acme")
        await add("g", "g1")
        await agrees()
        assert await store.revoke_key("acme", "a1")
        await agrees()
        assert _view(resolver, keys)["a1"] == "401"
        await store.rotate_salt("g1")
        await store.rotate_salt("acme")
        await store.update_tenant("acme", {"tier": "gold"})
        await agrees()
        await store.put_policy(parse_policy({**POLICY, "tiers": {"free": {}, "gold": {
            "limits": {"rpm": 9}}}}))
        await agrees()
        # a tenant deleted and made again under its id: its old keys stay gone
        await store.delete_tenant("acme")
        await store.create_tenant(Tenant(id="acme", tier="free"))
        await agrees()
        assert _view(resolver, keys)["a2"] == "401"
        assert resolver.authenticate(keys["g"]).tenant_id == "g1"

        # a key record written behind the store's back (no journal entry): read whole
        late = generate_key()
        r.hset("kvgate:keys", hash_key(late),
               KeyRecord(key_id="late", tenant_id="g1", key_hash=hash_key(late),
                         created_at=0.0).model_dump_json())
        r.incr("kvgate:gen")
        keys["late"] = late
        await agrees()
        assert resolver.authenticate(late).tenant_id == "g1"
    finally:
        r.close()
        await resolver.close()
        await store.close()


async def test_a_hand_edit_without_a_new_generation_is_read_within_whole_reload_s(
        redis_url: str) -> None:
    """A key record deleted by hand (redis-cli, no generation bump) stops authenticating once
    `WHOLE_RELOAD_S` passed since the last whole read, with no write to trigger a reload."""
    now = [0.0]
    store = RedisStore(connect_redis(redis_url), listen=False)
    resolver = TenantResolver(store, SaltDeriver(AUTH_SECRET), poll_interval_s=3600,
                              max_staleness_s=None, clock=lambda: now[0])
    r = redis.Redis.from_url(redis_url)
    try:
        await bootstrap(store, policy=parse_policy(POLICY), tenants=[Tenant(id="acme",
                                                                              tier="free")])
        key = generate_key()
        await store.add_key(KeyRecord(key_id="k", tenant_id="acme", key_hash=hash_key(key),
                                      created_at=0.0))
        await resolver.start()
        resolver.authenticate(key)
        assert r.hdel("kvgate:keys", hash_key(key)) == 1  # by hand: the generation stays
        now[0] += WHOLE_RELOAD_S - 1
        assert await resolver.refresh()
        resolver.authenticate(key)  # within the bound: the cache may still hold it
        now[0] += 2
        assert await resolver.refresh()
        with pytest.raises(AuthError):
            resolver.authenticate(key)
    finally:
        await resolver.close()
        await store.close()
        r.close()
