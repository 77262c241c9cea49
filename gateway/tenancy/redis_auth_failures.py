"""The admin API's failed-authentication budget of one client address, shared by every gateway
on one Redis (`RedisStore.auth_failures`, read by `gateway.admin.routes`).

A token bucket per address, ``<ns>:admin_auth:<address>`` (its level and time), refilled on
Redis's clock, expiring once full again: one gateway's failures count at every other, so N
gateways no longer give an address N times the guesses.
"""

from __future__ import annotations

from redis.commands.core import AsyncScript

from gateway.tenancy.redis_conn import redis_unavailable

__all__ = ["AUTH_FAILURES", "auth_failure_level"]

# KEYS[1] the address's bucket; ARGV[1] burst, ARGV[2] refill per second, ARGV[3] '1': take
# one failure. Returns the level (after the failure taken), as text (Lua numbers reach the
# client truncated to integers).
AUTH_FAILURES = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local burst, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'l', 'ts')
local level = burst
local was, at = tonumber(b[1]), tonumber(b[2])
if was and at then level = math.min(burst, was + math.max(0, now - at) * rate) end
if ARGV[3] == '1' then
  level = level - 1
  redis.call('HSET', KEYS[1], 'l', tostring(level), 'ts', tostring(now))
  redis.call('PEXPIRE', KEYS[1], math.ceil((burst - level) / rate * 1000) + 1000)
end
return tostring(level)
"""


async def auth_failure_level(script: AsyncScript, key: str, *, burst: float,
                             per_minute: float, charge: bool) -> float:
    """The failures left to the address of bucket `key` (below 1: throttled), one taken
    first when `charge`; `script` is `AUTH_FAILURES` registered on the store's client.
    `StoreUnreachable` when Redis does not answer."""
    with redis_unavailable():
        raw = await script(keys=[key], args=[burst, per_minute / 60.0, "1" if charge else "0"])
    return float(raw)
