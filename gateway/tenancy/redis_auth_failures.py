"""The admin API's failed-authentication budget of one client address, shared by every gateway
on one Redis (`RedisStore.auth_failures`, charged by `gateway.admin.routes`).

A token bucket per address, ``<ns>:admin_auth:<address>`` (its level and time), refilled on
Redis's clock, expiring once full again: one gateway's failures count at every other, so N
gateways no longer give an address N times the guesses. A failure that leaves the address
throttled is published (``<ns>:admin_auth``: the address and the level) to every gateway,
whose `AuthGuard` takes it in (`RedisStore` listens): the check before a token is looked at
stays in memory, and an admin request waits on no Redis call it did not need before. A
gateway that was not listening then (started since, or its subscription lost) reads the
addresses throttled now when it subscribes (`throttled_now`): it checked the token of a
throttled address, so a valid one got in at a gateway started after the throttle.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from gateway.tenancy.redis_conn import redis_unavailable

__all__ = ["AUTH_FAILURES", "auth_failure_level", "throttled_address", "throttled_now"]

# KEYS[1] the address's bucket; ARGV[1] burst, ARGV[2] refill per second, ARGV[3] the
# channel, ARGV[4] the address. Takes one failure (the bucket keeps its refill rate, for
# `throttled_now`); publishes the address and the level when
# that leaves it below 1. Returns the level, as text (Lua numbers reach the client truncated
# to integers).
AUTH_FAILURES = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local burst, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'l', 'ts')
local level = burst
local was, at = tonumber(b[1]), tonumber(b[2])
if was and at then level = math.min(burst, was + math.max(0, now - at) * rate) end
level = level - 1
redis.call('HSET', KEYS[1], 'l', tostring(level), 'ts', tostring(now), 'rate', tostring(rate))
redis.call('PEXPIRE', KEYS[1], math.ceil((burst - level) / rate * 1000) + 1000)
if level < 1 then redis.call('PUBLISH', ARGV[3], ARGV[4] .. ' ' .. tostring(level)) end
return tostring(level)
"""


async def auth_failure_level(script: AsyncScript, key: str, *, burst: float,
                             per_minute: float, channel: str, address: str) -> float:
    """One failure taken from `address`'s bucket `key`: the failures left (below 1:
    throttled, published on `channel`); `script` is `AUTH_FAILURES` registered on the store's
    client. `StoreUnreachable` when Redis does not answer."""
    with redis_unavailable():
        raw = await script(keys=[key], args=[burst, per_minute / 60.0, channel, address])
    return float(raw)


def throttled_address(data: str) -> tuple[str, float] | None:
    """A message of the channel: (address, level), None when it is not one."""
    address, _, level = data.rpartition(" ")
    try:
        return (address, float(level)) if address else None
    except ValueError:
        return None


async def throttled_now(client: aioredis.Redis, prefix: str) -> list[tuple[str, float]]:
    """(address, level) of every address whose bucket (``<prefix><address>``) is below one
    failure now, on Redis's clock. A bucket lives only until it is full again, so few are
    found; one written by an older kvgate (no rate in it) is left out. Redis's errors as
    redis-py raises them (the store's listener retries)."""
    found: list[tuple[str, float]] = []
    keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
    if not keys:
        return found
    async with client.pipeline(transaction=False) as pipe:
        pipe.time()
        for key in keys:
            pipe.hmget(key, "l", "ts", "rate")
        clock, *buckets = await pipe.execute(raise_on_error=False)
    if isinstance(clock, Exception):
        raise clock
    now = float(clock[0]) + float(clock[1]) / 1e6
    for key, bucket in zip(keys, buckets, strict=True):
        try:  # a key of another type (its error) or fields that are no numbers: none of these
            level, at, rate = (float(v) for v in bucket)
        except (TypeError, ValueError):
            continue
        now_level = level + max(0.0, now - at) * rate
        if now_level < 1.0:
            found.append((str(key).removeprefix(prefix), now_level))
    return found
