"""A store that subscribes reads the admin addresses throttled before it listened
(`redis_auth_failures.throttled_now`), and tells them as a published throttle is told. Redis
refusing that read (an ACL user without SCAN) costs only that: said in the log, the listener
goes on and tells the throttles published from then on.

Real redis-server, `RedisStore`s as each gateway holds one.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.tenancy.redis_conn import connect_redis
from gateway.tenancy.redis_store import RedisStore

BURST, PER_MINUTE = 3.0, 6.0


async def _throttle(store: RedisStore, address: str) -> None:
    for _ in range(int(BURST)):
        await store.auth_failures(address, burst=BURST, per_minute=PER_MINUTE)


async def _told(told: dict[str, float], address: str) -> float:
    for _ in range(300):
        if address in told:
            return told[address]
        await asyncio.sleep(0.02)
    raise AssertionError(f"{address} was never told")


async def test_a_store_that_subscribes_is_told_the_addresses_throttled_before(
        redis_url: str) -> None:
    writer = RedisStore(connect_redis(redis_url, timeout_s=5), listen=False)
    await _throttle(writer, "10.0.0.1")
    late = RedisStore(connect_redis(redis_url, timeout_s=5))
    told: dict[str, float] = {}
    late.on_auth_throttled = lambda address, level: told.__setitem__(address, level)
    await late.start()
    try:
        assert await _told(told, "10.0.0.1") < 1.0
        assert list(told) == ["10.0.0.1"]
    finally:
        await late.close()
        await writer.close()


async def test_a_refused_read_leaves_the_listener_working(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    admin = connect_redis(redis_url, timeout_s=5)
    await admin.acl_setuser("noscan", enabled=True, passwords=["+pw"], keys=["*"],
                            channels=["*"], commands=["+@all", "-scan"])
    writer = RedisStore(connect_redis(redis_url, timeout_s=5), listen=False)
    await _throttle(writer, "10.0.0.2")
    late = RedisStore(connect_redis(redis_url.replace("redis://", "redis://noscan:pw@"),
                                    timeout_s=5))
    told: dict[str, float] = {}
    late.on_auth_throttled = lambda address, level: told.__setitem__(address, level)
    caplog.set_level(logging.WARNING, logger="gateway.tenancy.redis_store")
    await late.start()
    try:
        said = ("could not be read (server replied NOPERM: the ACL user of KVGATE_REDIS_URL "
                "may not run SCAN)")
        for _ in range(300):
            if said in caplog.text:
                break
            await asyncio.sleep(0.02)
        assert said in caplog.text, caplog.text
        await _throttle(writer, "10.0.0.3")  # published: told all the same
        assert await _told(told, "10.0.0.3") < 1.0
        assert "10.0.0.2" not in told
        assert late.reach is not None and not late.reach.down
    finally:
        await late.close()
        await writer.close()
        await admin.aclose()
