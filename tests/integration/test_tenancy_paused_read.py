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
