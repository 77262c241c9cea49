"""A key of the wrong type (an operator or another application wrote a string where kvgate
keeps a hash, a list or a stream): Redis answers WRONGTYPE, which no retry cures and whose reply
names no key.

A tenant's rate-limit key: that tenant is admitted on per-process limits and named in the log
with its keys; every other tenant stays on the shared limits (it went per-process for everyone:
for good with a release stuck on the broken key, for a second after each of the tenant's
admissions). A fixed key of the store or the shared routing state: the log names it."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

import openai
import orjson
import pytest
import redis as sync_redis
import redis.asyncio as aioredis

from gateway.errors import StoreUnreachable
from gateway.fleet.settings import SyncSettings
from gateway.fleet.sync import RouteSync
from gateway.policy_doc import Limits, parse_policy
from gateway.tenancy import RedisRateLimiter, TenancySettings, Tenant, build_tenancy, connect_redis
from gateway.tenancy.fallback import FallbackRateLimiter
from gateway.tenancy.key_types import WRONG_TYPE, misplaced, name_wrong_types
from gateway.tenancy.redis_store import RedisStore
from routing.router import Router, RouterConfig
from tests.support.gateway import AUTH_SECRET, admin_client, chat_status, gateway_proc
from tests.support.procs import Proc

LIMITS = Limits(rpm=10, max_concurrency=2)
ADMIN = "wrong-type-admin-token-0123456789"


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_a_release_stuck_on_a_broken_key_holds_up_no_other_tenant(
    redis_url: str, r: aioredis.Redis,
) -> None:
    ns = f"t{secrets.token_hex(4)}"
    limiter = RedisRateLimiter(connect_redis(redis_url), namespace=ns)
    try:
        stuck = await limiter.admit("bad", LIMITS, tokens=1)
        await r.delete(f"{ns}:rl:{{bad}}:leases")
        await r.set(f"{ns}:rl:{{bad}}:leases", "written by hand")
        with pytest.raises(StoreUnreachable) as refused:
            await limiter.release(stuck)
        assert refused.value.cause == "server replied WRONGTYPE"
        assert limiter.unreleased == 1  # kept, retried until the key works

        good = await limiter.admit("good", LIMITS, tokens=1)  # it raised WRONGTYPE too
        assert good.allowed and good.remaining_requests == 9
        assert limiter.unreleased == 1

        await r.delete(f"{ns}:rl:{{bad}}:leases")
        assert (await limiter.admit("bad", LIMITS, tokens=1)).allowed
        assert limiter.unreleased == 0
    finally:
        await limiter.close()


@pytest.mark.parametrize(("key", "limits"), [(":leases", LIMITS), (":reserved", Limits(tpm=1000)),
                                             (":holders", LIMITS)])
async def test_an_admission_refused_as_wrong_type_leaves_nothing_to_give_back(
    redis_url: str, r: aioredis.Redis, key: str, limits: Limits,
) -> None:
    """Redis refuses the tenant's admission script before it writes a lease or a mark, on
    every request of the tenant (the fallback sends it to Redis each time): each refusal
    was kept as a lease or reservation to give back, retried for good, and carried by each
    of the tenant's next admissions -- a set growing with every request, scanned by every
    tenant's."""
    ns = f"t{secrets.token_hex(4)}"
    limiter = RedisRateLimiter(connect_redis(redis_url), namespace=ns)
    try:
        await r.set(f"{ns}:rl:{{bad}}{key}", "written by hand")
        for _ in range(3):
            with pytest.raises(StoreUnreachable):
                await limiter.admit("bad", limits, tokens=100)
        assert limiter.unreleased == 0
    finally:
        await limiter.close()


async def test_one_tenant_of_the_wrong_type_keeps_the_others_on_redis(
    redis_url: str, r: aioredis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    ns = f"t{secrets.token_hex(4)}"
    client = connect_redis(redis_url)
    limiter = FallbackRateLimiter(RedisRateLimiter(client, namespace=ns), address="redis",
                                  replicas=2)
    caplog.set_level(logging.INFO, logger="gateway.tenancy")
    rpm = Limits(rpm=10)
    try:
        await r.set(f"{ns}:rl:{{bad}}", "written by hand")
        for _ in range(3):
            bad = await limiter.admit("bad", rpm, tokens=1)
            assert bad.allowed and bad.degraded  # on this process's share (10 / 2)
            good = await limiter.admit("good", rpm, tokens=1)
            assert good.allowed and not good.degraded  # it went per-process for 1 s
        assert not limiter.degraded  # Redis answers
        assert bad.remaining_requests == 2 and good.remaining_requests == 7
        lines = [m.getMessage() for m in caplog.records]
        assert lines == [
            f"rate limits of tenant bad: Redis refused its keys: {ns}:rl:{{bad}} is a "
            "string, not a hash (WRONGTYPE: written by hand or another application?); it is "
            "admitted on per-process limits until it is deleted"], lines

        await r.delete(f"{ns}:rl:{{bad}}")
        back = await limiter.admit("bad", rpm, tokens=1)
        assert back.allowed and not back.degraded and back.remaining_requests == 9
        assert caplog.records[-1].getMessage() == (
            "rate limits of tenant bad: its keys in Redis work again")
    finally:
        await limiter.close()


async def test_a_broken_lease_key_stops_no_other_tenants_renewals(
    redis_url: str, r: aioredis.Redis,
) -> None:
    """Live leases are renewed in one call for every tenant: a WRONGTYPE on one tenant's key
    failed it, and every tenant's leases expired after their TTL while their requests ran."""
    ns = f"t{secrets.token_hex(4)}"
    limiter = RedisRateLimiter(connect_redis(redis_url), namespace=ns, lease_ttl_s=30)
    try:
        good = await limiter.admit("good", LIMITS, tokens=1)
        await limiter.admit("bad", LIMITS, tokens=1)
        await r.delete(f"{ns}:rl:{{bad}}:leases")
        await r.set(f"{ns}:rl:{{bad}}:leases", "written by hand")
        before = await r.zscore(f"{ns}:rl:{{good}}:leases", good.lease_id or "")
        assert await limiter.renew() == 2
        after = await r.zscore(f"{ns}:rl:{{good}}:leases", good.lease_id or "")
        assert before is not None and after is not None and after > before
    finally:
        await limiter.close()


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(10):
        while not condition():  # noqa: ASYNC110 - polling a condition with a deadline
            await asyncio.sleep(0.02)


async def test_the_store_names_its_key_of_the_wrong_type(
    redis_url: str, r: aioredis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    """The journal overwritten: every reload fails (after `max_staleness_s`, every request
    is refused) and the log said only "server replied WRONGTYPE"."""
    tenancy = build_tenancy(TenancySettings(poll_interval_s=0.1), "wrong-type-secret-0123456789",
                            redis_url)
    policy = parse_policy({"pools": {"p": {"served_model": "m", "replicas": ["http://x:1"]}},
                           "models": {"m": {"default": "p"}}})
    caplog.set_level(logging.WARNING, logger="gateway.tenancy")
    try:
        await tenancy.start(tenants=[Tenant(id="acme", tier="default")], policy=policy)
        await r.delete("kvgate:journal")
        await r.set("kvgate:journal", "written by hand")
        await r.incr("kvgate:gen")  # a write by another process: reloaded from the journal
        await _until(lambda: tenancy.resolver.health().degraded)
        lines = [m.getMessage() for m in caplog.records]
        assert any(line.endswith("(server replied WRONGTYPE: kvgate:journal is a string, "
                                 "not a list); retrying every 2 s") for line in lines), lines
        # and for /metrics and the doctor, a label without the key's name
        assert tenancy.resolver.health().store_cause == "wrongtype"
    finally:
        await tenancy.close()


async def test_a_generation_that_is_no_integer_is_a_key_of_the_wrong_type(
    redis_url: str, r: aioredis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    """The generation counter overwritten with what is not an integer: every reload failed
    as "store data unreadable (ValueError)", naming no key, with the store counted as
    answering; an admin write made its record and then failed on the counter (not
    journaled, not published: other gateways never read it), a 503 "did not answer". It is
    now what a key of the wrong type is: the log names it and says what to set it to, the
    cause is ``wrongtype``, and a write is refused whole."""
    tenancy = build_tenancy(TenancySettings(poll_interval_s=0.1), "wrong-type-secret-0123456789",
                            redis_url)
    policy = parse_policy({"pools": {"p": {"served_model": "m", "replicas": ["http://x:1"]}},
                           "models": {"m": {"default": "p"}}})
    caplog.set_level(logging.WARNING, logger="gateway.tenancy")
    try:
        await tenancy.start(tenants=[Tenant(id="acme", tier="default")], policy=policy)
        newest = int((await r.get("kvgate:gen")) or 0)
        await r.set("kvgate:gen", "written by hand")
        await _until(lambda: tenancy.resolver.health().degraded)
        lines = [m.getMessage() for m in caplog.records]
        assert any(line.endswith(
            "(server replied WRONGTYPE: kvgate:gen is not an integer (SET it to "
            f"{newest + 1}, past the newest generation in kvgate:journal)); retrying every 2 s")
            for line in lines), lines
        health = tenancy.resolver.health()
        assert (health.store_cause, health.store_answers, health.reason) == (
            "wrongtype", False, "store refuses kvgate's commands: server replied WRONGTYPE: "
            f"kvgate:gen is not an integer (SET it to {newest + 1}, past the newest generation "
            "in kvgate:journal)")
        with pytest.raises(StoreUnreachable) as refused:
            await tenancy.store.create_tenant(Tenant(id="globex", tier="default"))
        assert "refused the request (WRONGTYPE)" in refused.value.message
        assert not await r.hexists("kvgate:tenants", "globex")

        await r.set("kvgate:gen", newest + 1)  # as the log says: the gateways recover
        await _until(lambda: not tenancy.resolver.health().degraded)
    finally:
        await tenancy.close()


async def test_the_shared_routing_state_names_its_stream_of_the_wrong_type(
    redis_url: str, r: aioredis.Redis, caplog: pytest.LogCaptureFixture,
) -> None:
    sync = RouteSync(Router(RouterConfig()), redis_url, "kvgate", SyncSettings(),
                     own_loads=dict, known=lambda _: True, clock=time.monotonic, member="me")
    caplog.set_level(logging.WARNING, logger="gateway.fleet")
    await r.set("kvgate:routes", "written by hand")
    await sync.start()
    try:
        await _until(lambda: sync.degraded)
        await _until(lambda: bool(caplog.records))
        assert caplog.records[0].getMessage().endswith(
            "(server replied WRONGTYPE: kvgate:routes is not a stream (delete it)); retrying "
            "every 0.5 s")
        assert sync.down_cause == "wrongtype"
    finally:
        await sync.stop()


def test_through_the_gateway_the_other_tenants_stay_on_the_shared_budget(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    """What clients see: the tenant whose lease key was overwritten is still served (on its
    per-process share), and another tenant's requests are still counted in Redis, where the
    other gateways count them too (they were counted in this process only)."""
    _, sim = sim_factory("--time-scale", "50", model="m")
    config = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {"limits": {"rpm": 1000, "max_concurrency": 4}}},
        "tenants": [{"id": "acme", "tier": "free"}, {"id": "globex", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    r = sync_redis.Redis.from_url(redis_url)
    with gw, admin_client(base, ADMIN) as admin:
        keys = {t: admin.post(f"/tenants/{t}/keys").json()["key"] for t in ("acme", "globex")}
        clients = {t: openai.OpenAI(base_url=f"{base}/v1", api_key=k, max_retries=0, timeout=30)
                   for t, k in keys.items()}
        # (a seeded tenant's keys are named by its incarnation too: `Tenant.limits_key`)
        globex = _limits_key(r, "globex")
        r.set(f"kvgate:rl:{{{globex}}}:leases", "written by hand")
        assert chat_status(clients["globex"]) == 200  # per-process
        for _ in range(3):
            assert chat_status(clients["acme"]) == 200
        left = r.hget(f"kvgate:rl:{{{_limits_key(r, 'acme')}}}", "r")  # three counted in Redis
        assert left is not None and float(left) < 998, left
        assert "rate limits of tenant globex: Redis refused its keys" in gw.output()
    r.close()


def _limits_key(r: sync_redis.Redis, tenant: str) -> str:
    """The name of a tenant's rate-limit state: its id and incarnation, as stored."""
    record = r.hget("kvgate:tenants", tenant)
    assert record is not None, tenant
    return f"{tenant}#{orjson.loads(record)['incarnation']}"


async def test_a_stalled_release_goes_with_the_tenants_next_admission(
    redis_url: str, r: aioredis.Redis,
) -> None:
    """The tenant's next admission frees its stalled lease in the same call: one round trip,
    not a release pipeline (two, with its script check) and then the admission (on a Redis
    slowed to 200 ms a command, a limited tenant's p99 was 0.8-1.2 s)."""
    ns = f"t{secrets.token_hex(4)}"
    limiter = RedisRateLimiter(connect_redis(redis_url), namespace=ns)
    try:
        first = await limiter.admit("acme", Limits(max_concurrency=1), tokens=1)
        await r.delete(f"{ns}:rl:{{acme}}:leases")
        await r.set(f"{ns}:rl:{{acme}}:leases", "written by hand")
        with pytest.raises(StoreUnreachable):
            await limiter.release(first)
        assert limiter.unreleased == 1  # its release, stalled
        await r.delete(f"{ns}:rl:{{acme}}:leases")
        await r.config_resetstat()
        again = await limiter.admit("acme", Limits(max_concurrency=1), tokens=1)
        stats = await r.info("commandstats")
        assert again.allowed and limiter.unreleased == 0
        sent = {name: stat["calls"] for name, stat in stats.items()  # (not the scripts' own)
                if name.startswith(("cmdstat_eval", "cmdstat_script"))}
        assert sent == {"cmdstat_evalsha": 1}, sent
    finally:
        await limiter.close()


async def test_shared_limits_an_acl_user_may_not_run_are_degraded_with_the_cause(
    redis_url: str, r: aioredis.Redis,
) -> None:
    """An ACL user without a command kvgate's admission script calls: Redis refuses it inside
    the script with ERR, not NOPERM. It was logged as "server replied ERR" and answered as a
    Redis that "did not answer; retry shortly"; the fallback names the refusal."""
    await r.acl_setuser("kvgate", enabled=True, passwords=["+pw"], keys=["*"],
                        commands=["+@all", "-pexpire"])
    user_url = redis_url.replace("redis://", "redis://kvgate:pw@")
    ns = f"t{secrets.token_hex(4)}"
    primary = RedisRateLimiter(connect_redis(user_url), namespace=ns)
    limiter = FallbackRateLimiter(primary, address="redis", replicas=1)
    try:
        with pytest.raises(StoreUnreachable) as refused:
            await primary.admit("acme", LIMITS, tokens=1)
        assert refused.value.cause == ("server replied NOPERM: the ACL user of KVGATE_REDIS_URL "
                                       "lacks a permission kvgate needs")  # (in a script)
        assert "(NOPERM)" in refused.value.message
        assert limiter.down_cause is None
        assert (await limiter.admit("acme", LIMITS, tokens=1)).degraded
        assert limiter.degraded and limiter.down_cause == "noperm"
    finally:
        await limiter.close()


@pytest.mark.parametrize("value", ["99999999999999999999", "9223372036854775807", "1" * 5000])
async def test_a_generation_incr_cannot_bump_refuses_a_write_whole(
    redis_url: str, r: aioredis.Redis, value: str,
) -> None:
    """A counter of digits past what INCR takes (beyond a signed 64-bit integer, or at its
    end, with no room left): the scripts took it for an integer, wrote their record, then
    failed on INCR ("ERR ... out of range": not journaled, not published, and named as no
    key; past 4,300 digits a read failed on `int` too). It is refused as a counter that
    holds no integer, before anything is written."""
    store = RedisStore(connect_redis(redis_url), listen=False)
    try:
        await r.set("kvgate:gen", value)
        with pytest.raises(StoreUnreachable) as refused:
            await store.create_tenant(Tenant(id="globex", tier="default"))
        assert refused.value.cause == "server replied WRONGTYPE"
        assert not await r.hexists("kvgate:tenants", "globex")
        with pytest.raises(StoreUnreachable) as refused:
            await store.generation()
        assert refused.value.cause == "server replied WRONGTYPE"
        assert await misplaced(r, "kvgate") == [
            "kvgate:gen is not an integer (SET it to an integer past the newest generation "
            "in kvgate:journal)"]
    finally:
        await store.close()


@pytest.mark.parametrize("value", ["-5", "0", "9223372036854775805", "-9223372036854775808"])
async def test_a_generation_incr_can_bump_is_taken(
    redis_url: str, r: aioredis.Redis, value: str,
) -> None:
    store = RedisStore(connect_redis(redis_url), listen=False)
    try:
        await r.set("kvgate:gen", value)
        assert await store.generation() == int(value)
        await store.create_tenant(Tenant(id="globex", tier="default"))
        assert await store.generation() == int(value) + 1
        assert await misplaced(r, "kvgate") == []
    finally:
        await store.close()


async def test_keys_whose_type_cannot_be_read_are_named_as_none(
    redis_url: str, r: aioredis.Redis,
) -> None:
    """An ACL user that may not run TYPE: each refused TYPE was named as a key whose type is
    the refusal's text ("kvgate:tenants is a this user has no permissions to run the 'type'
    command, not a hash; ..."); the keys are left unnamed and the counter, read with GET,
    still is."""
    await r.acl_setuser("kvgate", enabled=True, passwords=["+pw"], keys=["*"],
                        commands=["+@all", "-type"])
    user = aioredis.Redis.from_url(redis_url.replace("redis://", "redis://kvgate:pw@"))
    try:
        await r.set("kvgate:gen", "written by hand")
        assert await name_wrong_types(user, "kvgate", WRONG_TYPE) == (
            f"{WRONG_TYPE}: kvgate:gen is not an integer (SET it to an integer past the newest "
            "generation in kvgate:journal)")
    finally:
        await user.aclose()


async def test_a_journal_entry_of_5000_digits_names_the_counter_still(
    redis_url: str, r: aioredis.Redis,
) -> None:
    """A hand-written journal head whose generation has 5,000 digits: what to SET the
    counter to was read with `int`, which refuses past 4,300 digits (ValueError)."""
    await r.set("kvgate:gen", "written by hand")
    await r.lpush("kvgate:journal", "9" * 5000 + " tenant acme")
    assert await misplaced(r, "kvgate") == [
        "kvgate:gen is not an integer (SET it to an integer past the newest generation in "
        "kvgate:journal)"]
