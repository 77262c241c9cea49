"""Lease holders on a real Redis: a tenant found full drops the leases of a holder whose
heartbeat is gone (deleted by a supervisor, or expired), never those of a live holder, nor
lease ids without a holder (an older kvgate's)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis

from gateway.policy_doc import Limits
from gateway.tenancy import RedisRateLimiter, connect_redis
from gateway.tenancy.holders import forget_holder, holder_key, holder_note
from tests.support.procs import free_port

NS = "lh"
FULL = Limits(max_concurrency=2)


@pytest.fixture
async def pair(redis_url: str) -> AsyncIterator[tuple[RedisRateLimiter, RedisRateLimiter]]:
    """Two processes' limiters (a "dead" one never beats: only its admissions wrote its
    heartbeat), heartbeats living 0.3 s."""
    made = [RedisRateLimiter(connect_redis(redis_url), namespace=NS, holder_ttl_s=0.3)
            for _ in range(2)]
    yield made[0], made[1]
    for lim in made:
        await lim.close()


async def _fill(lim: RedisRateLimiter) -> None:
    for _ in range(FULL.max_concurrency or 0):
        assert (await lim.admit("acme", FULL, tokens=0)).allowed


async def test_a_deleted_heartbeat_frees_its_leases_at_the_next_admission(
    pair: tuple[RedisRateLimiter, RedisRateLimiter], redis_url: str, tmp_path: Path,
) -> None:
    dead, alive = pair
    await _fill(dead)
    assert not (await alive.peek("acme", FULL)).allowed
    file = holder_note(tmp_path, 0)
    file.write(dead.holder)  # as a worker does at start
    assert forget_holder(redis_url, NS, file, timeout_s=1.0)  # its supervisor saw it die
    assert not file.path.exists()
    assert (await alive.peek("acme", FULL)).allowed
    assert (await alive.admit("acme", FULL, tokens=0)).allowed
    assert (await alive.admit("acme", FULL, tokens=0)).allowed
    assert not (await alive.admit("acme", FULL, tokens=0)).allowed  # its own still count
    assert not forget_holder(redis_url, NS, file, timeout_s=1.0)  # nothing left to forget


async def test_an_expired_heartbeat_frees_its_leases(
    pair: tuple[RedisRateLimiter, RedisRateLimiter],
) -> None:
    dead, alive = pair
    await _fill(dead)
    assert not (await alive.admit("acme", FULL, tokens=0)).allowed  # alive for 0.3 s
    await asyncio.sleep(0.5)
    assert (await alive.admit("acme", FULL, tokens=0)).allowed


async def test_a_live_holder_keeps_its_leases_past_the_heartbeat_ttl(
    pair: tuple[RedisRateLimiter, RedisRateLimiter],
) -> None:
    live, other = pair
    await live.start()  # beats every 0.1 s while it holds leases
    await _fill(live)
    await asyncio.sleep(1.0)
    assert not (await other.admit("acme", FULL, tokens=0)).allowed


async def test_a_lease_without_a_holder_counts_to_its_ttl(
    pair: tuple[RedisRateLimiter, RedisRateLimiter], redis_url: str,
) -> None:
    _, alive = pair
    plain = redis.Redis.from_url(redis_url)
    try:  # two leases as an older kvgate writes them: random hex ids, no holder
        now = float(plain.time()[0])
        plain.zadd(f"{NS}:rl:{{acme}}:leases", {"0123456789abcdef": now + 30,
                                                "fedcba9876543210": now + 30})
        assert plain.exists(holder_key(NS, "0123456789abcdef")) == 0
    finally:
        plain.close()
    assert not (await alive.admit("acme", FULL, tokens=0)).allowed


def test_forgetting_a_holder_while_redis_is_down_is_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    file = holder_note(tmp_path, 3)
    file.write("abcdef012345")
    caplog.set_level(logging.WARNING, logger="gateway.tenancy.holders")
    assert not forget_holder(f"redis://127.0.0.1:{free_port()}/0", NS, file, timeout_s=0.5)
    assert [r.getMessage() for r in caplog.records] == [
        "cannot free a dead worker's concurrency leases at once (ConnectionError): they stop "
        "counting within tenancy.lease_holder_ttl_s"]


async def test_a_dead_holder_leaves_the_tenants_holders(
    pair: tuple[RedisRateLimiter, RedisRateLimiter], redis_url: str,
) -> None:
    dead, alive = pair
    await _fill(dead)
    plain = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        holders = f"{NS}:rl:{{acme}}:holders"
        assert plain.smembers(holders) == {dead.holder}
        plain.delete(holder_key(NS, dead.holder))
        assert (await alive.admit("acme", FULL, tokens=0)).allowed
        assert plain.smembers(holders) == {alive.holder}
    finally:
        plain.close()


async def test_the_holders_of_leases_renewed_past_their_ttl_are_still_known(
    redis_url: str,
) -> None:
    """Leases renewed for longer than their TTL with no admission of the tenant meanwhile:
    its holders set lives as long (the renewal names the holder again)."""
    live = RedisRateLimiter(connect_redis(redis_url), namespace=NS, lease_ttl_s=3.0)
    other = RedisRateLimiter(connect_redis(redis_url), namespace=NS)
    try:
        await live.start()  # renews every second
        await _fill(live)
        await asyncio.sleep(5.0)  # the set written at admission would have expired at 4 s
        await live.close()  # dies: its leases are still live in Redis (renewed < 1 s ago)
        plain = redis.Redis.from_url(redis_url)
        plain.delete(holder_key(NS, live.holder))  # as its supervisor does
        plain.close()
        assert (await other.admit("acme", FULL, tokens=0)).allowed
    finally:
        await live.close()
        await other.close()
