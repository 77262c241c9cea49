"""A tenant's rate-limit key of another type (written by hand): the log line names the key
that is wrong, with its type. It named four of the six keys the admission script uses,
whichever was wrong (its lease take times and mean hold time not at all)."""

from __future__ import annotations

import logging
import secrets

import pytest
import redis.asyncio as aioredis

from gateway.errors import StoreUnreachable
from gateway.policy_doc import Limits
from gateway.tenancy import RedisRateLimiter, connect_redis

ONE = Limits(rpm=100, tpm=10_000, max_concurrency=1)


@pytest.mark.parametrize(("suffix", "written", "is_a"), [
    ("", "set", "string, not a hash"), (":leases", "set", "string, not a zset"),
    (":reserved", "set", "string, not a zset"), (":holders", "set", "string, not a set"),
    (":held", "set", "string, not a zset"), (":hold", "hset", "hash, not a string"),
])
async def test_the_key_of_the_wrong_type_is_the_one_named(
    redis_url: str, caplog: pytest.LogCaptureFixture, suffix: str, written: str, is_a: str,
) -> None:
    ns = f"t{secrets.token_hex(4)}"
    bucket = f"{ns}:rl:{{bad}}"
    r = aioredis.Redis.from_url(redis_url)
    limiter = RedisRateLimiter(connect_redis(redis_url), namespace=ns)
    caplog.set_level(logging.ERROR, logger="gateway.tenancy")
    # a reservation is marked only without a concurrency limit
    limits = Limits(tpm=10_000) if suffix == ":reserved" else ONE
    try:
        held = await limiter.admit("bad", limits, tokens=1)  # its slot taken: the next is refused
        assert held.allowed
        await r.delete(bucket + suffix)
        if written == "set":
            await r.set(bucket + suffix, "written by hand")
        else:
            await r.hset(bucket + suffix, "by", "hand")
        with pytest.raises(StoreUnreachable):  # (a refusal reads the take times and mean)
            await limiter.admit("bad", limits, tokens=1)
        lines = [m.getMessage() for m in caplog.records if "refused its keys" in m.getMessage()]
        assert len(lines) == 1, lines
        assert f"{bucket}{suffix} is a {is_a}" in lines[0], lines
        others = [f"{bucket}{s}" for s in ("", ":leases", ":reserved", ":holders", ":held",
                                           ":hold") if s != suffix]
        assert not any(f"{o} " in lines[0] or f"{o};" in lines[0] for o in others), lines
    finally:
        await limiter.close()
        await r.aclose()
