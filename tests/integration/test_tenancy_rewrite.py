"""Stored records this gateway meets through the admin API, written straight into a real Redis
behind its back: fields a newer kvgate wrote survive this one's rewrites; a record that cannot
be read is a clear 409 (never a 500) with a way out; an unreadable salt epoch or policy does
not stop the load, and the admin API and `kvgate admin policy get` say what is in force."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator

import openai
import pytest
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
from gateway.tenancy.salts import FRESH_EPOCH_MIN
from tests.support.gateway import (
    AUTH_SECRET,
    GatewayProc,
    acme_gateway,
    admin_client,
    chat_status,
    metric_values,
    wait_for,
)
from tests.support.procs import KVGATE, Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "rewrite-admin-token-0123456789abcdef"
STALE_S = 1.0
SKIPPED = "kvgate_tenancy_records_skipped_total"
TENANCY = {"poll_interval_s": 0.1, "max_staleness_s": STALE_S}


@pytest.fixture
def gateway(sim_factory: SimFactory, redis_url: str) -> Iterator[tuple[GatewayProc, str]]:
    _, sim = sim_factory("--time-scale", "50", model="m")
    gw, base = acme_gateway(sim, redis_url, ADMIN, {}, tenancy=TENANCY)
    with gw:
        yield gw, base


def _redis(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def _write(redis_url: str, key: str, field: str, value: str) -> None:
    """HSET one record behind the gateway's back and bump the generation (as a write would)."""
    r = _redis(redis_url)
    try:
        r.hset(key, field, value)
        r.incr("kvgate:gen")
    finally:
        r.close()


def _stored(redis_url: str, key: str, field: str) -> dict[str, object]:
    r = _redis(redis_url)
    try:
        return json.loads(r.hget(key, field) or "null")  # type: ignore[no-any-return]
    finally:
        r.close()


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def test_fields_a_newer_kvgate_wrote_survive_this_ones_rewrites(
    gateway: tuple[GatewayProc, str], redis_url: str
) -> None:
    _, base = gateway
    with admin_client(base, ADMIN) as admin:
        record = {"id": "acme", "tier": "free", "limits": {"rpm": 9, "new_limit": 7},
                  "new_field": {"any": "thing"}}
        _write(redis_url, "kvgate:tenants", "acme", json.dumps(record))
        patched = admin.patch("/tenants/acme", json={"limits": {"tpm": 500}})
        assert patched.status_code == 200, patched.text
        assert patched.json()["limits"] == {"rpm": 9, "tpm": 500}
        stored = _stored(redis_url, "kvgate:tenants", "acme")
        assert stored["new_field"] == {"any": "thing"}, stored
        assert stored["limits"] == {"rpm": 9, "tpm": 500, "new_limit": 7}, stored
        # a known field the write drops stays dropped (null: back to the tier's limit)
        assert admin.patch("/tenants/acme", json={"limits": {"rpm": None}}).status_code == 200
        assert admin.post("/tenants/acme/rotate-salt").status_code == 200
        stored = _stored(redis_url, "kvgate:tenants", "acme")
        assert stored["limits"] == {"tpm": 500, "new_limit": 7}, stored
        assert stored["new_field"] == {"any": "thing"} and stored["salt_epoch"] == 1, stored

        # the policy: a PATCH (read-modify-write) keeps the stored document's unknown fields
        doc = admin.get("/policy").json()
        doc["new_section"] = {"x": 1}
        doc["pools"]["p"]["new_pool_option"] = True
        _write(redis_url, "kvgate:policy", "doc", json.dumps(doc))
        patched = admin.patch("/policy", json={"tiers": {"free": {"priority": 3}}})
        assert patched.status_code == 200, patched.text
        assert "new_section" not in patched.json()  # this gateway does not know it
        stored = _stored(redis_url, "kvgate:policy", "doc")
        assert stored["new_section"] == {"x": 1}, stored
        assert stored["pools"]["p"]["new_pool_option"] is True, stored  # type: ignore[index]
        assert stored["tiers"]["free"]["priority"] == 3, stored  # type: ignore[index]


def test_an_unreadable_tenant_is_a_409_and_can_be_written_over(
    gateway: tuple[GatewayProc, str], redis_url: str
) -> None:
    gw, base = gateway
    with admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        for garbage in ("{not json at all", json.dumps({"id": "acme", "tier": 5})):
            _write(redis_url, "kvgate:tenants", "acme", garbage)
            for method, path in (("GET", "/tenants/acme"), ("PATCH", "/tenants/acme"),
                                 ("POST", "/tenants/acme/rotate-salt")):
                body = {"limits": {"rpm": 3}} if method == "PATCH" else None
                answer = admin.request(method, path, json=body)
                assert answer.status_code == 409, (method, path, answer.text)
                error = answer.json()["error"]
                assert error["code"] == "record_unreadable", error
                assert "unreadable" in error["message"] and "POST /admin/tenants" in \
                    error["message"], error
                # and the CLI commands that do it, as the policy's refusal names its own
                assert "kvgate admin tenants create acme --tier" in error["message"], error
                assert "kvgate admin tenants delete acme" in error["message"], error
                assert garbage not in answer.text
        # the way out: create it again over the unreadable record; its keys are kept
        created = admin.post("/tenants", json={"id": "acme", "tier": "free"})
        assert created.status_code == 201, created.text
        got = admin.get("/tenants/acme")
        assert got.status_code == 200
        # the answer lists the keys it kept (it said `keys: []`), as a GET does
        assert created.json() == got.json() and len(got.json()["keys"]) == 1, created.text
        wait_for(lambda: chat_status(_client(base, key)) == 200, what="the old key again")
        # a readable tenant is still a conflict, as before
        assert admin.post("/tenants", json={"id": "acme", "tier": "free"}).status_code == 409
    assert "Traceback" not in gw.output()


def test_an_unreadable_policy_is_said_so_with_what_is_in_force(
    gateway: tuple[GatewayProc, str], redis_url: str, sim_factory: SimFactory
) -> None:
    gw, base = gateway
    env = {"KVGATE_ADMIN_TOKEN": ADMIN}
    cli = [*KVGATE, "admin", "--url", base, "policy", "get"]
    with admin_client(base, ADMIN) as admin:
        assert admin.get("/policy").status_code == 200
        _write(redis_url, "kvgate:policy", "doc", "{broken")
        wait_for(lambda: metric_values(base, SKIPPED)['{kind="policy"}'] == 1.0,
                 what="the skipped policy")
        answer = admin.get("/policy")
        assert answer.status_code == 409, answer.text
        message = answer.json()["error"]["message"]
        assert "policy document is unreadable" in message, message
        assert "last readable version, 1" in message and "PUT /admin/policy" in message
        # so does `kvgate admin policy get`
        run = subprocess.run(cli, capture_output=True, text=True, timeout=60,
                             env={**_env(), **env})
        assert run.returncode != 0 and "unreadable" in run.stderr, run
        assert "last readable version, 1" in run.stderr, run.stderr
        # a PATCH cannot merge into it (409), a PUT writes over it
        assert admin.patch("/policy", json={"tiers": {"free": {}}}).status_code == 409
        doc = {"pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
               "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}}
        put = admin.put("/policy", json=doc)
        assert put.status_code == 200, put.text
        assert admin.get("/policy").status_code == 200
        # a version that is not a number: unreadable too, and a PUT still writes over it
        _write(redis_url, "kvgate:policy", "version", "three")
        assert admin.get("/policy").status_code == 409
        put = admin.put("/policy", json=doc)
        assert put.status_code == 200, put.text
        assert int(put.headers["etag"].strip('"')) > 2, put.headers
        assert admin.get("/policy").status_code == 200
        _write(redis_url, "kvgate:policy", "doc", "{broken again")
    # a gateway that never read a readable policy runs on its configuration's, and says so
    gw.stop()
    _, sim = sim_factory("--time-scale", "50", model="m")
    later, base = acme_gateway(sim, redis_url, ADMIN, {}, tenancy=TENANCY)
    with later, admin_client(base, ADMIN) as admin:
        message = admin.get("/policy").json()["error"]["message"]
        assert "configuration's policy" in message, message
        key = admin.post("/tenants/acme/keys").json()["key"]  # not refused: a tier is known
        assert chat_status(_client(base, key)) == 200


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}


async def test_an_unreadable_salt_epoch_is_skipped_not_the_whole_load(redis_url: str) -> None:
    """Before: ``int("x")`` failed the whole load, so past `max_staleness_s` every tenant got
    503s. Now the group's record is skipped and counted; its tenants keep the last epoch this
    process read, or are refused (503) when it read none -- never salted from a guess."""
    policy = parse_policy({"pools": {"p": {"served_model": "m", "replicas": ["http://x:1"]}},
                           "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}})
    salts = SaltDeriver(AUTH_SECRET)
    store = RedisStore(connect_redis(redis_url), listen=False)
    old = TenantResolver(store, salts, poll_interval_s=3600, max_staleness_s=STALE_S)
    new = TenantResolver(store, salts, poll_interval_s=3600, max_staleness_s=STALE_S)
    keys = {tid: generate_key() for tid in ("solo", "g1")}
    try:
        await bootstrap(store, policy=policy, tenants=[
            Tenant(id="solo", tier="free"), Tenant(id="g1", tier="free", salt_group="pub")])
        for tid, key in keys.items():
            await store.add_key(KeyRecord(key_id=tid, tenant_id=tid, key_hash=hash_key(key),
                                          created_at=0.0))
        assert (await store.rotate_salt("g1")).epoch == 1
        await old.start()
        assert old.authenticate(keys["g1"]).cache_salt == salts.derive("group:pub", 1)
        _write(redis_url, "kvgate:salt_groups", "pub", "x")
        assert await old.refresh(), "one bad epoch failed the whole load"
        assert old.authenticate(keys["solo"]).cache_salt == salts.derive("tenant:solo", 0)
        # the last epoch this process read stays in force for the group
        assert old.authenticate(keys["g1"]).cache_salt == salts.derive("group:pub", 1)
        health = old.health()
        assert health.records_skipped == {"salt_group": 1} and health.degraded
        assert "salt group 'pub'" in (health.reason or "")
        # a process that never read it refuses the group's tenants, serves the others
        await new.start()
        assert new.authenticate(keys["solo"]).tier_known
        with pytest.raises(Exception) as refused:
            new.authenticate(keys["g1"])
        assert getattr(refused.value, "status", None) == 503, refused.value
        assert "salt group 'pub'" in str(refused.value)
        assert "kvgate admin rotate-salt g1" in str(refused.value)  # named, not a placeholder
        # rotating it is the way out: a fresh epoch, never one the group had before
        epoch = (await store.rotate_salt("g1")).epoch
        assert epoch >= FRESH_EPOCH_MIN
        assert await new.refresh()
        assert new.authenticate(keys["g1"]).cache_salt == salts.derive("group:pub", epoch)
        assert not new.health().degraded
    finally:
        await old.close()
        await new.close()
        await store.close()


@pytest.mark.parametrize(("stored", "readable"), [
    ("007", False), (str(2**63), False), (str(2**70), False), ("-5", False),
    (str(2**63 - 1), True),  # the largest epoch: read, but HINCRBY cannot count past it
])
async def test_an_epoch_redis_cannot_count_from_is_rotated_to_a_fresh_one(
    redis_url: str, stored: str, readable: bool
) -> None:
    """A salt group's epoch is a decimal integer from 0 to 2**63 - 1 without leading zeros.
    Before, "007" and anything past 2**63 - 1 were read as epochs (7, a huge one) while
    every rotation of the group failed: HINCRBY refused them, a 503 each time."""
    policy = parse_policy({"pools": {"p": {"served_model": "m", "replicas": ["http://x:1"]}},
                           "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}})
    salts = SaltDeriver(AUTH_SECRET)
    store = RedisStore(connect_redis(redis_url), listen=False)
    resolver = TenantResolver(store, salts, poll_interval_s=3600, max_staleness_s=None)
    key = generate_key()
    try:
        await bootstrap(store, policy=policy, tenants=[
            Tenant(id="g1", tier="free", salt_group="pub")])
        await store.add_key(KeyRecord(key_id="k", tenant_id="g1", key_hash=hash_key(key),
                                      created_at=0.0))
        _write(redis_url, "kvgate:salt_groups", "pub", stored)
        await resolver.start()
        if readable:
            assert resolver.authenticate(key).cache_salt == salts.derive(
                "group:pub", int(stored))
        else:  # skipped, counted, and its tenants refused rather than salted from a guess
            assert resolver.health().records_skipped == {"salt_group": 1}
            with pytest.raises(Exception) as refused:
                resolver.authenticate(key)
            assert getattr(refused.value, "status", None) == 503
        epoch = (await store.rotate_salt("g1")).epoch  # a 503 before
        assert FRESH_EPOCH_MIN <= epoch < 2**52
        assert await resolver.refresh()
        assert resolver.authenticate(key).cache_salt == salts.derive("group:pub", epoch)
        assert (await store.rotate_salt("g1")).epoch == epoch + 1  # counted from there on
    finally:
        await resolver.close()
        await store.close()


def test_a_bad_epoch_is_counted_by_a_running_gateway(
    gateway: tuple[GatewayProc, str], redis_url: str
) -> None:
    _, base = gateway
    with admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        _write(redis_url, "kvgate:salt_groups", "elsewhere", "1.5")
        time.sleep(STALE_S + 1.0)  # past the staleness window: a failed load would be 503s
        assert chat_status(_client(base, key)) == 200
        later = admin.post("/tenants/acme/keys").json()["key"]
        wait_for(lambda: chat_status(_client(base, later)) == 200, what="the later key")
        assert metric_values(base, SKIPPED)['{kind="salt_group"}'] == 1.0
