"""A gateway cut off from Redis (here: paused with SIGSTOP, so it reads nothing) while another
revokes a key and deletes a tenant, the store then wiped (FLUSHALL): on coming back it must not
write its stale state back. It did (its state was younger than max_staleness_s), and the
revoked key and the deleted tenant's key worked again on every gateway."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx
import openai
import pytest
import redis
import redis.asyncio

from gateway.errors import AuthError
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
from tests.integration.test_tenancy_wipe import POLICY, Clock
from tests.support.gateway import (
    AUTH_SECRET,
    acme_gateway,
    admin_client,
    chat_status,
    metric_values,
    wait_for,
)
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "cut-off-admin-token-0123456789"
FAST = {"poll_interval_s": 0.1}


def _key(admin: httpx.Client, tenant: str) -> str:
    if tenant != "acme":
        assert admin.post("/tenants", json={"id": tenant, "tier": "free"}).status_code == 201
    made = admin.post(f"/tenants/{tenant}/keys")
    assert made.status_code == 201, made.text
    return str(made.json()["key"])


def _client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)


def _works(base: str, key: str) -> None:
    wait_for(lambda: chat_status(_client(base, key)) == 200, what="the key on the gateway")


def _restored(base: str) -> None:
    wait_for(lambda: metric_values(base, "kvgate_tenancy_store_resets_total") == {"": 1.0},
             what="the wipe noticed")
    wait_for(lambda: not httpx.get(f"{base}/readyz").json()["degraded"],
             what="restored: not degraded")


def test_a_gateway_cut_off_while_keys_were_revoked_does_not_restore_them(
    sim_factory: SimFactory,
) -> None:
    proc, redis_url = redis_proc()
    _, sim = sim_factory("--time-scale", "50", model="m")
    proc.start()
    one, base1 = acme_gateway(sim, redis_url, ADMIN, {}, tenancy=FAST)
    two, base2 = acme_gateway(sim, redis_url, ADMIN, {}, tenancy=FAST)
    with proc, one, two, admin_client(base1, ADMIN) as admin:
        revoked, kept = _key(admin, "acme"), _key(admin, "acme")
        gone = _key(admin, "beta")
        revoked_id = admin.get("/tenants/acme").json()["keys"][0]["id"]
        for key in (revoked, kept, gone):
            _works(base2, key)

        two.signal(signal.SIGSTOP)  # cut off: it reads nothing from the store from now on
        try:
            assert admin.delete(f"/tenants/acme/keys/{revoked_id}").status_code == 204
            assert admin.delete("/tenants/beta").status_code == 204
            wait_for(lambda: chat_status(_client(base1, revoked)) == 401, what="revoked")
            one.stop()  # the gateway that revoked goes away (scaled down, redeployed)
            time.sleep(1.5)  # cut off longer than two of its checks and a second
            redis.Redis.from_url(redis_url).flushall()  # ... and the store is wiped
        finally:
            two.signal(signal.SIGCONT)

        def noticed() -> bool:
            return metric_values(base2, "kvgate_tenancy_store_resets_total") == {"": 1.0}

        wait_for(noticed, what="the wipe noticed by the gateway cut off")
        wait_for(lambda: chat_status(_client(base2, kept)) == 401,
                 what="its stale state not served after the re-seed")
        # neither the revoked key nor the deleted tenant came back into the store
        assert chat_status(_client(base2, revoked)) == 401
        assert chat_status(_client(base2, gone)) == 401
        with admin_client(base2, ADMIN) as admin2:
            assert [t["id"] for t in admin2.get("/tenants").json()["data"]] == ["acme"]
            assert admin2.get("/tenants/acme").json()["keys"] == []
        ready = httpx.get(f"{base2}/readyz").json()
        assert ready["degraded"] and "re-issue" in str(ready), ready
        assert "cut off from the store" in two.output()


def test_a_gateway_in_touch_restores_while_the_cut_off_one_waits(
    sim_factory: SimFactory,
) -> None:
    """The gateway that revoked is still there: the cut-off one, back first, leaves the
    restore to it (it wrote its own state back when it came back first: whichever noticed
    first won), then reloads what it wrote: the revoked key stays revoked, the rest works."""
    proc, redis_url = redis_proc()
    _, sim = sim_factory("--time-scale", "50", model="m")
    proc.start()
    # the gateway in touch checks every 0.5 s: the cut-off one, checking every 0.1 s, is
    # almost always first to find the store wiped
    one, base1 = acme_gateway(sim, redis_url, ADMIN, {}, tenancy={"poll_interval_s": 0.5})
    two, base2 = acme_gateway(sim, redis_url, ADMIN, {}, tenancy=FAST)
    with proc, one, two, admin_client(base1, ADMIN) as admin:
        revoked, kept = _key(admin, "acme"), _key(admin, "acme")
        revoked_id = admin.get("/tenants/acme").json()["keys"][0]["id"]
        for key in (revoked, kept):
            _works(base2, key)
        two.signal(signal.SIGSTOP)
        try:
            assert admin.delete(f"/tenants/acme/keys/{revoked_id}").status_code == 204
            wait_for(lambda: chat_status(_client(base1, revoked)) == 401, what="revoked")
            time.sleep(1.5)  # cut off longer than two of its checks and a second
            redis.Redis.from_url(redis_url).flushall()
        finally:
            two.signal(signal.SIGCONT)
        for base in (base1, base2):
            _restored(base)
            assert chat_status(_client(base, kept)) == 200
            assert chat_status(_client(base, revoked)) == 401
        logs = one.output() + two.output()
        assert "restored 1 tenants and 1 keys from this gateway's last state" in one.output(), logs


def test_a_redis_restarted_empty_is_restored_by_the_gateways(sim_factory: SimFactory) -> None:
    """The common wipe: Redis restarted without persistence, every gateway without it for
    longer than two checks and a second. Their state is what the store held when it stopped
    (nothing could be written while it was down): written back, keys made through the admin
    API work again. (A rule that restored only from a state confirmed within two checks
    re-seeded from configuration here: every tenant's key lost.)"""
    proc, redis_url = redis_proc()
    _, sim = sim_factory("--time-scale", "50", model="m")
    proc.start()
    one, base1 = acme_gateway(sim, redis_url, ADMIN, {}, tenancy=FAST)
    two, base2 = acme_gateway(sim, redis_url, ADMIN, {}, tenancy=FAST)
    with proc, one, two, admin_client(base1, ADMIN) as admin:
        key = _key(admin, "acme")
        for base in (base1, base2):
            _works(base, key)
        proc.stop()
        time.sleep(2.5)  # longer than two of their checks and a second
        proc.start()  # empty: no persistence
        for base in (base1, base2):
            _restored(base)
            assert chat_status(_client(base, key)) == 200


class _RunningLong(RedisStore):
    """The resolvers' clock below is simulated (11 s pass at once); the server's uptime is
    real and may be shorter: a FLUSHALL on a server that ran through those 11 s, as a wipe
    in place is, says so."""

    async def up_for_s(self) -> float | None:
        return 3600.0


async def test_each_wipe_found_cut_off_waits_for_a_gateway_in_touch(redis_url: str) -> None:
    """A gateway cut off waits (a check that reads nothing) at every wipe it finds so, not
    only the first: its wait began at the first one and was never reset, so at the next wipe
    it re-seeded at once instead of leaving the restore to a gateway in touch."""
    clocks = [Clock(), Clock()]
    stores = [_RunningLong(connect_redis(redis_url), listen=False) for _ in range(2)]
    seed = [Tenant(id="acme", tier="free")]
    resolvers = [TenantResolver(s, SaltDeriver(AUTH_SECRET), poll_interval_s=3600,
                                max_staleness_s=10, clock=c) for s, c in zip(stores, clocks,
                                                                               strict=True)]
    for store, resolver in zip(stores, resolvers, strict=True):
        async def reseed(store: RedisStore = store) -> None:
            await bootstrap(store, tenants=seed, policy=POLICY)
        resolver.reseed_with(reseed)
    await bootstrap(stores[0], tenants=seed, policy=POLICY)
    key = generate_key()
    await stores[0].add_key(KeyRecord(key_id="k1", tenant_id="acme", key_hash=hash_key(key),
                                      created_at=1.0))
    r = redis.asyncio.Redis.from_url(redis_url)
    in_touch, cut_off = resolvers
    try:
        for resolver in resolvers:
            await resolver.start()
        for _ in range(2):  # two wipes
            await r.flushall()
            clocks[1].now += 11  # its state confirmed 11 s ago: max_staleness_s 10
            assert not await cut_off.refresh()  # it waits, writes nothing
            assert await r.hget("kvgate:keys", hash_key(key)) is None
            assert await in_touch.refresh()  # restores
            assert await cut_off.refresh()  # reloads what it wrote
            assert cut_off.authenticate(key).tenant_id == "acme"
    finally:
        await r.aclose()
        for resolver in resolvers:
            await resolver.close()
        for store in stores:
            await store.close()


async def test_a_lost_keys_hash_written_back_by_a_gateway_cut_off_leaves_out_the_revoked(
    redis_url: str,
) -> None:
    """The other restore path: the store keeps its marker but loses its keys hash (evicted)
    after a key was revoked while a gateway was cut off; that gateway, first to find the
    loss, writes back its records in force but the revoked one (the journal names it)."""
    stores = [RedisStore(connect_redis(redis_url), listen=False) for _ in range(2)]
    seed = [Tenant(id="acme", tier="free")]
    await bootstrap(stores[0], tenants=seed, policy=POLICY)
    keys = [generate_key() for _ in range(2)]
    for n, key in enumerate(keys):
        await stores[0].add_key(KeyRecord(key_id=f"k{n}", tenant_id="acme",
                                          key_hash=hash_key(key), created_at=1.0))
    clock = Clock()
    cut_off = TenantResolver(stores[1], SaltDeriver(AUTH_SECRET), poll_interval_s=3600,
                             max_staleness_s=300, clock=clock)
    r = redis.asyncio.Redis.from_url(redis_url)
    try:
        await cut_off.start()
        assert await stores[0].revoke_key("acme", "k0")  # while it reads nothing
        await r.delete("kvgate:keys")  # the hash lost
        clock.now += 31  # its next whole read finds the loss (`WHOLE_RELOAD_S`)
        assert await cut_off.refresh()
        written = await r.hkeys("kvgate:keys")
        assert hash_key(keys[0]).encode() not in written
        assert hash_key(keys[1]).encode() in written
        with pytest.raises(AuthError):
            cut_off.authenticate(keys[0])
        assert cut_off.authenticate(keys[1]).tenant_id == "acme"
    finally:
        await r.aclose()
        await cut_off.close()
        for store in stores:
            await store.close()
