"""A gateway paused between sending a read to the store and taking its answer (SIGSTOP, a
stalled node) took the old answer for a state just confirmed: a key revoked meanwhile, the
store then wiped, it wrote its state back at once, revoked key included (CI saw it as a
flaky cut-off test). And the server's uptime not read in time (a timeout on a loaded
machine) was taken for "the server does not say": restored the same way."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio

from gateway.errors import AuthError, StoreUnreachable
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
from tests.support.gateway import AUTH_SECRET
from tests.support.procs import redis_proc


class _PausedOnce(RedisStore):
    """Its next generation read is answered, then the process pauses 11 s (the simulated
    clock) before going on, while the other gateway revokes a key."""

    def __init__(self, *args: object, clock: Clock, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.clock = clock
        self.meanwhile: RedisStore | None = None

    async def generation(self) -> int:
        answer = await super().generation()
        if self.meanwhile is not None:
            assert await self.meanwhile.revoke_key("acme", "k0")
            self.meanwhile = None
            self.clock.now += 11
        return answer

    async def up_for_s(self) -> float | None:
        return 3600.0  # the server ran through the simulated pause: a wipe in place


async def test_a_state_read_before_a_pause_is_not_written_back_over_a_wipe(
    redis_url: str,
) -> None:
    clocks = [Clock(), Clock()]
    in_touch_store = RedisStore(connect_redis(redis_url), listen=False)
    paused_store = _PausedOnce(connect_redis(redis_url), listen=False, clock=clocks[1])
    stores: list[RedisStore] = [in_touch_store, paused_store]
    seed = [Tenant(id="acme", tier="free")]
    resolvers = [TenantResolver(s, SaltDeriver(AUTH_SECRET), poll_interval_s=3600,
                                max_staleness_s=10, clock=c)
                 for s, c in zip(stores, clocks, strict=True)]
    for store, resolver in zip(stores, resolvers, strict=True):
        async def reseed(store: RedisStore = store) -> None:
            await bootstrap(store, tenants=seed, policy=POLICY)
        resolver.reseed_with(reseed)
    await bootstrap(in_touch_store, tenants=seed, policy=POLICY)
    keys = [generate_key() for _ in range(2)]
    for n, key in enumerate(keys):
        await in_touch_store.add_key(KeyRecord(key_id=f"k{n}", tenant_id="acme",
                                               key_hash=hash_key(key), created_at=1.0))
    r = redis.asyncio.Redis.from_url(redis_url)
    in_touch, paused = resolvers
    try:
        for resolver in resolvers:
            await resolver.start()
        paused_store.meanwhile = in_touch_store
        await paused.refresh()  # answered, paused 11 s, k0 revoked meanwhile
        assert await in_touch.refresh()
        await r.flushall()
        assert not await paused.refresh()  # its state is 11 s old: it waits, writes nothing
        assert await r.hget("kvgate:keys", hash_key(keys[0])) is None
        assert await in_touch.refresh()  # restores its state, k0 revoked
        assert await paused.refresh()
        with pytest.raises(AuthError):
            paused.authenticate(keys[0])
        assert paused.authenticate(keys[1]).tenant_id == "acme"
    finally:
        await r.aclose()
        for resolver in resolvers:
            await resolver.close()
        for store in stores:
            await store.close()


async def test_the_servers_uptime_unread_fails_the_check_and_refused_says_nothing() -> None:
    proc, url = redis_proc()
    proc.start()
    with proc:
        admin = redis.Redis.from_url(url)
        admin.acl_setuser("noinfo", enabled=True, passwords=["+noinfo-pass-0123"], keys=["*"],
                          commands=["+@all", "-info"])
        admin.close()
        limited = url.replace("redis://", "redis://noinfo:noinfo-pass-0123@", 1)
        refused = RedisStore(connect_redis(limited), listen=False)
        plain = RedisStore(connect_redis(url), listen=False)
        try:
            assert await refused.up_for_s() is None  # INFO refused by an ACL: does not say
            up = await plain.up_for_s()
            assert up is not None and up >= 0
            proc.stop()
            with pytest.raises(StoreUnreachable):
                await plain.up_for_s()  # not reached: the check fails, tried again
        finally:
            await refused.close()
            await plain.close()


class _SlowLoads(RedisStore):
    """Each refresh takes 1.2 s of the simulated clock (a big store, a loaded node)."""

    clock: Clock | None = None

    async def generation(self) -> int:
        answer = await super().generation()
        if self.clock is not None:
            self.clock.now += 1.2
        return answer


async def test_a_load_slower_than_max_staleness_still_serves(redis_url: str) -> None:
    """The staleness served counts from the end of the last load: counted from its start (as
    the wipe's judgement is), a load slower than max_staleness_s left every request a 503
    while every load succeeded."""
    clock = Clock()
    store = _SlowLoads(connect_redis(redis_url), listen=False)
    await bootstrap(store, tenants=[Tenant(id="acme", tier="free")], policy=POLICY)
    key = generate_key()
    await store.add_key(KeyRecord(key_id="k0", tenant_id="acme", key_hash=hash_key(key),
                                  created_at=1.0))
    resolver = TenantResolver(store, SaltDeriver(AUTH_SECRET), poll_interval_s=0.5,
                              max_staleness_s=1.0, clock=clock)
    store.clock = clock
    try:
        await resolver.start()
        for _ in range(3):
            assert await resolver.refresh()
            assert resolver.authenticate(key).tenant_id == "acme"
    finally:
        await resolver.close()
        await store.close()


class _UptimeUnread(RedisStore):
    """A server whose INFO never answers in time (a proxy closing on it, a slow INFO)."""

    async def up_for_s(self) -> float | None:
        raise StoreUnreachable("timed out")


async def test_an_uptime_never_read_restores_after_the_in_touch_wait(redis_url: str) -> None:
    """The uptime is asked again for two checks and a second, then read as the server not
    saying (restored, as before the uptime rule): a server that never answered INFO kept the
    store wiped for good, every request a 503."""
    clock = Clock()
    store = _UptimeUnread(connect_redis(redis_url), listen=False)
    seed = [Tenant(id="acme", tier="free")]
    resolver = TenantResolver(store, SaltDeriver(AUTH_SECRET), poll_interval_s=0.5,
                              max_staleness_s=10, clock=clock)

    async def reseed() -> None:
        await bootstrap(store, tenants=seed, policy=POLICY)

    resolver.reseed_with(reseed)
    await bootstrap(store, tenants=seed, policy=POLICY)
    key = generate_key()
    await store.add_key(KeyRecord(key_id="k0", tenant_id="acme", key_hash=hash_key(key),
                                  created_at=1.0))
    r = redis.asyncio.Redis.from_url(redis_url)
    try:
        await resolver.start()
        clock.now += 3  # cut off longer than two checks and a second, then wiped
        await r.flushall()
        assert not await resolver.refresh()  # the uptime unread: tried again
        clock.now += 1
        assert not await resolver.refresh()
        clock.now += 1.5  # past the in-touch wait (2 s)
        assert await resolver.refresh()  # restored from its state
        assert await r.hget("kvgate:keys", hash_key(key)) is not None
        assert resolver.authenticate(key).tenant_id == "acme"
    finally:
        await r.aclose()
        await resolver.close()
        await store.close()
