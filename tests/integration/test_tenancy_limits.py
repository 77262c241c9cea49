"""One behavioural table for admission, run against MemoryRateLimiter and RedisRateLimiter.

Both use an injected clock here so bucket refill is exact (Redis's own clock in production).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.policy_doc import Limits
from gateway.tenancy import MemoryRateLimiter, RateLimiter, RedisRateLimiter, connect_redis
from gateway.tenancy.limits import POSITIVE_S
from tests.support.procs import redis_proc


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[str]:
    proc, url = redis_proc()
    with proc:
        yield url


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["memory", "redis"])
async def limiter(request: pytest.FixtureRequest, clock: Clock) -> AsyncIterator[RateLimiter]:
    lim: RateLimiter
    if request.param == "memory":
        lim = MemoryRateLimiter(clock=clock)
    else:
        client = connect_redis(request.getfixturevalue("shared_redis"))
        lim = RedisRateLimiter(
            client, namespace=f"t{secrets.token_hex(4)}", clock=clock, lease_ttl_s=30
        )
    yield lim
    await lim.close()


async def test_rpm_allows_the_limit_then_denies_until_refill(
    limiter: RateLimiter, clock: Clock
) -> None:
    limits = Limits(rpm=3)
    results = [await limiter.admit("t", limits, tokens=1) for _ in range(4)]
    assert [a.allowed for a in results] == [True, True, True, False]
    denied = results[-1]
    assert denied.reason == "rpm" and denied.retry_after_s == pytest.approx(20.0)
    assert denied.headers()["retry-after"] == "20"
    assert results[0].headers()["x-ratelimit-remaining-requests"] == "2"
    assert results[0].headers()["x-ratelimit-limit-requests"] == "3"
    clock.now += 20.0  # one request's worth of refill
    assert (await limiter.admit("t", limits, tokens=1)).allowed
    assert not (await limiter.admit("t", limits, tokens=1)).allowed


async def test_tenants_have_separate_budgets(limiter: RateLimiter) -> None:
    limits = Limits(rpm=1)
    assert (await limiter.admit("a", limits, tokens=0)).allowed
    assert (await limiter.admit("b", limits, tokens=0)).allowed
    assert not (await limiter.admit("a", limits, tokens=0)).allowed


async def test_tpm_charges_estimate_then_settles_real_usage(
    limiter: RateLimiter, clock: Clock
) -> None:
    limits = Limits(tpm=100)
    first = await limiter.admit("t", limits, tokens=80)
    assert first.allowed and first.remaining_tokens == 20
    second = await limiter.admit("t", limits, tokens=80)  # balance > 0: admitted, overshoots
    assert second.allowed and second.remaining_tokens == 0
    third = await limiter.admit("t", limits, tokens=1)  # at most one request of overshoot
    assert not third.allowed and third.reason == "tpm"
    await limiter.settle(first, used_tokens=10)  # gives back 70
    await limiter.settle(second, used_tokens=20)  # gives back 60 -> balance 70
    await limiter.settle(second, used_tokens=999)  # idempotent
    fourth = await limiter.admit("t", limits, tokens=5)
    assert fourth.allowed and fourth.remaining_tokens == 65


async def test_tpm_admits_only_on_a_positive_balance(limiter: RateLimiter) -> None:
    """The boundary: a bucket drained to exactly 0 admits nothing more (no free request)."""
    limits = Limits(tpm=100)
    first = await limiter.admit("t", limits, tokens=100)  # the whole minute's budget
    assert first.allowed and first.remaining_tokens == 0
    at_zero = await limiter.admit("t", limits, tokens=1)
    assert not at_zero.allowed and at_zero.reason == "tpm"
    # admitted again once the balance is above zero: a millisecond (it said one token's
    # refill, 0.6 s: 60/TPM s late)
    assert at_zero.retry_after_s == pytest.approx(POSITIVE_S)
    assert at_zero.headers()["retry-after-ms"] == "1"


async def test_settle_charges_output_tokens_beyond_the_estimate(limiter: RateLimiter) -> None:
    limits = Limits(tpm=100)
    a = await limiter.admit("t", limits, tokens=10)
    await limiter.settle(a, used_tokens=150)  # a long stream: balance now -50
    denied = await limiter.admit("t", limits, tokens=1)
    assert not denied.allowed and denied.retry_after_s == pytest.approx(50 * 60 / 100 + POSITIVE_S)


async def test_a_tpm_refusal_waits_as_long_as_the_bucket_does(
    limiter: RateLimiter, clock: Clock
) -> None:
    """Retry-After of a TPM refusal is when the bucket admits again: a client that waits
    that long is admitted, one that retries a few milliseconds sooner is not. It was the
    time to a balance of one token: 60/TPM s late (6 s on this 10 TPM budget)."""
    limits = Limits(tpm=10)
    spent = await limiter.admit("t", limits, tokens=13)  # admitted on a full bucket: owes 3
    assert spent.allowed
    denied = await limiter.admit("t", limits, tokens=1)
    assert not denied.allowed and denied.reason == "tpm"
    assert denied.retry_after_s == pytest.approx(3 * 60 / 10 + POSITIVE_S)  # 18.001 s
    assert denied.headers()["retry-after-ms"] == "18001"
    assert denied.headers()["retry-after"] == "19"
    start = clock.now
    clock.now = start + denied.retry_after_s - 0.005
    assert not (await limiter.admit("t", limits, tokens=1)).allowed  # (charges nothing)
    clock.now = start + int(denied.headers()["retry-after-ms"]) / 1000
    assert (await limiter.admit("t", limits, tokens=1)).allowed


async def test_concurrency_leases_are_acquired_and_released(limiter: RateLimiter) -> None:
    limits = Limits(max_concurrency=2)
    a = await limiter.admit("t", limits, tokens=0)
    b = await limiter.admit("t", limits, tokens=0)
    c = await limiter.admit("t", limits, tokens=0)
    assert (a.allowed, b.allowed, c.allowed) == (True, True, False)
    assert c.reason == "concurrency" and c.lease_id is None
    await limiter.release(a)
    await limiter.release(a)  # idempotent: must not free b's slot
    assert (await limiter.admit("t", limits, tokens=0)).allowed
    assert not (await limiter.admit("t", limits, tokens=0)).allowed
    await limiter.finish(b, used_tokens=None)
    assert (await limiter.admit("t", limits, tokens=0)).allowed


async def test_denied_requests_consume_nothing(limiter: RateLimiter) -> None:
    limits = Limits(rpm=2, max_concurrency=1)
    a = await limiter.admit("t", limits, tokens=0)
    assert not (await limiter.admit("t", limits, tokens=0)).allowed  # concurrency
    await limiter.release(a)
    assert (await limiter.admit("t", limits, tokens=0)).allowed  # rpm budget was kept


async def test_unlimited_always_admits_without_headers(limiter: RateLimiter) -> None:
    for _ in range(20):
        adm = await limiter.admit("t", Limits(), tokens=1000)
        assert adm.allowed and adm.headers() == {}


async def test_redis_leases_of_a_dead_gateway_expire(shared_redis: str, clock: Clock) -> None:
    ns = f"t{secrets.token_hex(4)}"
    dead = RedisRateLimiter(connect_redis(shared_redis), namespace=ns, clock=clock, lease_ttl_s=30)
    alive = RedisRateLimiter(connect_redis(shared_redis), namespace=ns, clock=clock, lease_ttl_s=30)
    limits = Limits(max_concurrency=1)
    assert (await dead.admit("t", limits, tokens=0)).allowed  # never released: process "died"
    held = await alive.admit("t", limits, tokens=0)
    assert not held.allowed
    clock.now += 31
    mine = await alive.admit("t", limits, tokens=0)
    assert mine.allowed  # the dead gateway's lease expired
    clock.now += 20
    assert await alive.renew() == 1  # a live gateway keeps its lease alive past the TTL
    clock.now += 20
    assert not (await dead.admit("t", limits, tokens=0)).allowed


async def test_peek_decides_as_admit_and_charges_nothing(limiter: RateLimiter) -> None:
    limits = Limits(rpm=2, tpm=100, max_concurrency=1)
    for _ in range(3):  # peeking, however often, takes nothing from any budget
        peek = await limiter.peek("t", limits)
        assert peek.allowed and peek.lease_id is None and peek.reserved_tokens == 0
        assert peek.remaining_requests == 2 and peek.remaining_tokens == 100
    first = await limiter.admit("t", limits, tokens=10)
    assert first.allowed
    busy = await limiter.peek("t", limits)  # the one concurrent request is taken
    assert (busy.allowed, busy.reason) == (False, "concurrency")
    await limiter.release(first)
    assert (await limiter.peek("t", limits)).allowed
    assert (await limiter.admit("t", limits, tokens=10)).allowed  # the minute's second one
    over = await limiter.peek("t", Limits(rpm=2, tpm=100))
    assert (over.allowed, over.reason, over.remaining_requests) == (False, "rpm", 0)


# holds Redis (one thread) for ARGV[1] ms: commands sent meanwhile run after it
_HOLD_REDIS = """
local t = redis.call('TIME')
local stop = t[1] * 1000000 + t[2] + ARGV[1] * 1000
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= stop
return 1
"""


async def _cancelled_behind_held_redis(url: str, call: Coroutine[Any, Any, Any]) -> None:
    """Run `call` while Redis is held busy (300 ms, by another client with no socket
    timeout), cancel it once its command waits behind the hold, and return when the hold is
    over (the cancelled command has run in Redis by then)."""
    holder = aioredis.Redis.from_url(url)

    async def held() -> None:
        await holder.eval(_HOLD_REDIS, 0, "300")

    try:
        hold = asyncio.create_task(held())
        await asyncio.sleep(0.05)
        task = asyncio.create_task(call)
        await asyncio.sleep(0.1)  # sent, waiting behind the held server
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await hold
    finally:
        await holder.aclose()


async def test_an_admit_cancelled_while_redis_runs_it_frees_its_lease(shared_redis: str) -> None:
    """A client that leaves cancels its request while the admit script is on its way: Redis
    still runs the script and takes the lease. It is freed (before the next decision), not
    held for its 30 s TTL, which with max_concurrency 1 refused the tenant meanwhile."""
    lim = RedisRateLimiter(connect_redis(shared_redis), namespace=f"t{secrets.token_hex(4)}",
                           lease_ttl_s=30)
    limits = Limits(max_concurrency=1)
    try:
        await lim.release(await lim.admit("t", limits, tokens=0))  # the script is loaded
        await _cancelled_behind_held_redis(shared_redis, lim.admit("t", limits, tokens=0))
        again = await lim.admit("t", limits, tokens=0)
        assert again.allowed
        await lim.release(again)
    finally:
        await lim.close()


async def test_a_finish_cancelled_while_redis_settles_still_releases_its_lease(
    shared_redis: str,
) -> None:
    """The request's end (`finish`: settle the usage, then release the lease) cancelled
    while the settle waits on Redis -- an edge's cleanup cancelled again (gRPC cancelling
    the picker's handler as it closed; uvicorn's shutdown backstop): the release was skipped,
    the lease stayed live and renewed for as long as the process ran, and with
    max_concurrency 1 the tenant was refused from then on. The release runs whatever the
    settle did."""
    lim = RedisRateLimiter(connect_redis(shared_redis), namespace=f"t{secrets.token_hex(4)}",
                           lease_ttl_s=30)
    limits = Limits(tpm=1000, max_concurrency=1)
    try:
        adm = await lim.admit("t", limits, tokens=100)
        assert adm.allowed and adm.lease_id is not None
        await _cancelled_behind_held_redis(shared_redis, lim.finish(adm, 10))
        assert lim.unreleased == 0  # released once Redis answered, not left for a retry
        again = await lim.admit("t", limits, tokens=0)
        assert again.allowed, again.reason
        await lim.release(again)
    finally:
        await lim.close()


async def test_an_admit_cancelled_while_redis_runs_it_gives_back_its_reservation(
    shared_redis: str,
) -> None:
    """A client leaving the picker while its admission waits on a slow Redis: the script
    still runs, leases and reserves the request's tokens, and the request never reaches a
    replica. Its lease was freed, but its reservation (``max_tokens`` 900 of a 1,000 TPM
    budget) stayed charged until the bucket refilled (~54 s): it is given back with the
    lease."""
    lim = RedisRateLimiter(connect_redis(shared_redis), namespace=f"t{secrets.token_hex(4)}",
                           lease_ttl_s=30)
    limits = Limits(tpm=1000, max_concurrency=4)
    try:
        await lim.release(await lim.admit("t", limits, tokens=0))  # the script is loaded
        await _cancelled_behind_held_redis(shared_redis, lim.admit("t", limits, tokens=900))
        assert await lim.release_pending() == 0
        left = (await lim.peek("t", limits)).remaining_tokens
        assert left is not None and left >= 990, left  # (a refill of ~17 tokens a second)
        # a lease released as usual gives nothing back: the request's settle charges it
        used = await lim.admit("t", limits, tokens=500)
        await lim.release(used)
        left = (await lim.peek("t", limits)).remaining_tokens
        assert left is not None and left < 600, left
    finally:
        await lim.close()


async def test_an_admit_cancelled_while_redis_runs_it_gives_back_a_reservation_without_lease(
    shared_redis: str,
) -> None:
    """The same for a tenant with a TPM limit and no concurrency limit: no lease tells
    whether the cancelled admission's script ran, so its reservation stayed charged until the
    bucket refilled. The script marks each reservation (with the lease's TTL) and the
    admission's cleanup gives it back when the mark is found, once; an admission that goes on
    takes its mark away with its settle, in the settle's own call."""
    ns = f"t{secrets.token_hex(4)}"
    lim = RedisRateLimiter(connect_redis(shared_redis), namespace=ns, lease_ttl_s=30)
    check = aioredis.Redis.from_url(shared_redis)
    limits = Limits(tpm=1000)
    try:
        await lim.settle(await lim.admit("t", limits, tokens=0), 0)  # the scripts are loaded
        await _cancelled_behind_held_redis(shared_redis, lim.admit("t", limits, tokens=900))
        assert await lim.release_pending() == 0
        left = (await lim.peek("t", limits)).remaining_tokens
        assert left is not None and left >= 990, left
        assert await lim.release_pending() == 0  # given back once
        assert (await lim.peek("t", limits)).remaining_tokens == left
        # an admission settled as usual gives nothing back and leaves no mark behind, in the
        # two calls it made before (its admission, its settle)
        await check.config_resetstat()
        used = await lim.admit("t", limits, tokens=500)
        await lim.settle(used, 500)
        await lim.release(used)
        stats = await check.info("commandstats")
        sent = {name: stat["calls"] for name, stat in stats.items()  # (not the scripts' own)
                if name.startswith(("cmdstat_eval", "cmdstat_script"))}
        assert sent == {"cmdstat_evalsha": 2}, sent
        assert await check.zcard(f"{ns}:rl:{{t}}:reserved") == 0
        left = (await lim.peek("t", limits)).remaining_tokens
        assert left is not None and left < 600, left
    finally:
        await lim.close()
        await check.aclose()


async def test_a_settle_cancelled_before_it_reached_redis_is_still_made(
    shared_redis: str,
) -> None:
    """The request's end cancelled while its settle waits for a connection to Redis (a new
    one, whose handshake waits behind a busy Redis): the settle was never sent and, marked
    done, never retried; the reservation (900 tokens of a 1,000 TPM budget, for a request
    that used 10) stayed charged until the bucket refilled (~54 s). The settle runs in a
    task of its own that the cancellation does not reach."""
    client = connect_redis(shared_redis)
    lim = RedisRateLimiter(client, namespace=f"t{secrets.token_hex(4)}", lease_ttl_s=30)
    limits = Limits(tpm=1000)
    try:
        adm = await lim.admit("t", limits, tokens=900)
        await client.connection_pool.disconnect()  # the settle's command needs a new one
        await _cancelled_behind_held_redis(shared_redis, lim.finish(adm, 10))
    finally:
        await lim.close()  # waits for a settle still on its way
    left = (await lim.peek("t", limits)).remaining_tokens
    assert left is not None and left >= 980, left


async def test_a_stalled_release_does_not_change_the_tpm_a_cancelled_admission_gives_back(
    shared_redis: str,
) -> None:
    """An admission carries the tenant's stalled releases (a release cancelled, tpm 0: a
    lease gives back no tokens) and is itself cancelled while Redis runs it: its reservation
    was recorded for give-back with the stalled release's tpm (0), and the give-back capped
    the bucket at it -- the tenant's 1,000 TPM emptied instead of refilled by 900."""
    lim = RedisRateLimiter(connect_redis(shared_redis), namespace=f"t{secrets.token_hex(4)}",
                           lease_ttl_s=30)
    limits = Limits(tpm=1000, max_concurrency=4)
    try:
        first = await lim.admit("t", limits, tokens=0)
        await _cancelled_behind_held_redis(shared_redis, lim.release(first))
        assert lim.unreleased == 1
        await lim.peek("other", limits)  # a connection again (the cancel dropped its own)
        await _cancelled_behind_held_redis(shared_redis, lim.admit("t", limits, tokens=900))
        assert await lim.release_pending() == 0
        left = (await lim.peek("t", limits)).remaining_tokens
        assert left is not None and left >= 990, left
    finally:
        await lim.close()
