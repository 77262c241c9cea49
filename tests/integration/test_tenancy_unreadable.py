"""Tenancy records this gateway cannot fully read, written straight into Redis: a record from
a newer kvgate (an unknown field, during a rolling upgrade) is read with the field ignored; a
truly unreadable one is skipped, counted, logged once and reported by /readyz, while every
other tenant keeps working past `max_staleness_s`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import openai
import redis

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
ADMIN = "unreadable-admin-token-0123456789"
STALE_S = 1.0  # max_staleness_s of these gateways: a failed load shows within seconds
SKIPPED = "kvgate_tenancy_records_skipped_total"


def _write(redis_url: str, key: str, field: str, value: str) -> None:
    """HSET one record behind the gateway's back and bump the generation (as a write would)."""
    r = redis.Redis.from_url(redis_url)
    try:
        r.hset(key, field, value)
        r.incr("kvgate:gen")
    finally:
        r.close()


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_a_tenant_record_from_a_newer_version_is_read(
    sim_factory: SimFactory, redis_url: str
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    tenancy = {"poll_interval_s": 0.1, "max_staleness_s": STALE_S}
    gw, base = acme_gateway(sim, redis_url, ADMIN, {}, tenancy=tenancy)
    with gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        assert chat_status(_client(base, key)) == 200
        # a newer kvgate added an optional field, at the top and inside `limits`
        record = {"id": "acme", "tier": "free", "limits": {"rpm": 2, "new_limit": 7},
                  "new_field": {"any": "thing"}}
        _write(redis_url, "kvgate:tenants", "acme", json.dumps(record))
        time.sleep(STALE_S + 1.0)  # past the staleness window: a failed load would be 503s
        statuses = [chat_status(_client(base, key)) for _ in range(3)]
        assert statuses == [200, 200, 429], statuses  # the record's rpm 2 is in force
        ready = httpx.get(f"{base}/readyz").json()
        assert not ready["tenancy"]["degraded"], ready
        assert set(metric_values(base, SKIPPED).values()) == {0.0}
        assert admin.get("/tenants/acme").json()["limits"] == {"rpm": 2}
        # the admin API's input stays strict: an operator's typo is a 400, not ignored
        typo = admin.post("/tenants", json={"id": "beta", "tier": "free", "teir": "x"})
        assert typo.status_code == 400, typo.text
        typo = admin.patch("/tenants/acme", json={"limits": {"rmp": 5}})
        assert typo.status_code == 400, typo.text


def test_a_garbage_record_is_skipped_and_the_others_keep_working(
    sim_factory: SimFactory, redis_url: str
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    tenancy = {"poll_interval_s": 0.1, "max_staleness_s": STALE_S}
    gw, base = acme_gateway(sim, redis_url, ADMIN, {}, tenancy=tenancy)
    with gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        assert metric_values(base, SKIPPED) == {
            '{kind="key"}': 0.0, '{kind="policy"}': 0.0, '{kind="salt_group"}': 0.0,
            '{kind="tenant"}': 0.0}
        _write(redis_url, "kvgate:tenants", "ghost", "{not json at all")
        secret_hash = hash_key(generate_key())
        _write(redis_url, "kvgate:keys", secret_hash, '{"key_id": 5}')
        time.sleep(STALE_S + 1.0)  # past the staleness window: a failed load would be 503s
        assert chat_status(_client(base, key)) == 200
        # a key made after the garbage arrived works too: loads still succeed
        later = admin.post("/tenants/acme/keys").json()["key"]
        wait_for(lambda: chat_status(_client(base, later)) == 200, what="the later key")
        skipped = {'{kind="key"}': 1.0, '{kind="policy"}': 0.0, '{kind="salt_group"}': 0.0,
                   '{kind="tenant"}': 1.0}
        assert metric_values(base, SKIPPED) == skipped
        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 200
        tenancy_info = ready.json()["tenancy"]
        assert ready.json()["degraded"] and tenancy_info["degraded"]
        assert "unreadable" in tenancy_info["reason"] and "ghost" in tenancy_info["reason"]
        assert [t["id"] for t in admin.get("/tenants").json()["data"]] == ["acme"]
        out = gw.output()
        assert out.count("'ghost'") == 1, out  # logged once, not at every reload
        assert secret_hash not in out and secret_hash not in tenancy_info["reason"]
        # removed by an operator: readable again, no longer degraded (the counter stays)
        r = redis.Redis.from_url(redis_url)
        try:
            r.hdel("kvgate:tenants", "ghost")
            r.hdel("kvgate:keys", secret_hash)
            r.incr("kvgate:gen")
        finally:
            r.close()
        wait_for(lambda: not httpx.get(f"{base}/readyz").json()["degraded"], what="readable")
        assert metric_values(base, SKIPPED) == skipped


async def test_an_unreadable_policy_keeps_the_last_one_in_force(redis_url: str) -> None:
    """The policy is one record: unreadable, it is skipped and the last readable one stays in
    force (rather than none, which would refuse every tenant)."""
    policy = parse_policy({"pools": {"p": {"served_model": "m", "replicas": ["http://x:1"]}},
                           "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}})
    store = RedisStore(connect_redis(redis_url, timeout_s=5), listen=False)
    resolver = TenantResolver(store, SaltDeriver(AUTH_SECRET), poll_interval_s=3600,
                              max_staleness_s=STALE_S)
    try:
        await bootstrap(store, tenants=[Tenant(id="acme", tier="free")], policy=policy)
        key = generate_key()
        await store.add_key(KeyRecord(key_id="k", tenant_id="acme", key_hash=hash_key(key),
                                      created_at=0.0))
        await resolver.start()
        assert resolver.authenticate(key).tier_known
        r = redis.Redis.from_url(redis_url)
        try:
            r.hset("kvgate:policy", "doc", "{broken")
            r.incr("kvgate:gen")
        finally:
            r.close()
        assert await resolver.refresh()
        principal = resolver.authenticate(key)
        assert principal.tier_known and resolver.policy is not None
        health = resolver.health()
        # the readiness reason names the record in words (it read "policy 'policy'": the
        # record's kind, then its name, which for the one policy is its kind again)
        assert health.degraded and health.reason == (
            "1 unreadable record(s) in the store skipped: the policy document (fix or delete "
            "them)")
        assert health.records_skipped == {"policy": 1}
    finally:
        await resolver.close()
        await store.close()
