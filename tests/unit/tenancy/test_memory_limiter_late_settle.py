"""A request longer than its reservation's refill (a stream without ``max_tokens``: the
prompt and the expected output reserved, thousands of tokens generated over tens of seconds)
settles its excess on the bucket it was admitted on, even when a sweep for full buckets ran
meanwhile (as the Redis limiter's bucket, kept 61 s after its last admission)."""

from __future__ import annotations

import asyncio

from gateway.policy_doc import Limits
from gateway.tenancy import limits as limits_mod
from gateway.tenancy.limits import MemoryRateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_late_excess_is_charged_after_a_sweep() -> None:
    async def run() -> tuple[bool, str | None]:
        clock = Clock()
        lim = MemoryRateLimiter(clock=clock)
        limits = Limits(tpm=10_000)
        stream = await lim.admit("streamer", limits, tokens=300)  # refilled in 1.8 s
        clock.now += 20.0  # the stream goes on; other tenants come and go
        for i in range(limits_mod.MIN_SWEEP + 1):  # enough of them for a sweep
            await lim.finish(await lim.admit(f"other-{i}", limits, tokens=10), 10)
        await lim.finish(stream, 30_000)  # 29,700 past its reservation
        clock.now += 1.0
        after = await lim.admit("streamer", limits, tokens=300)
        return after.allowed, after.reason
    assert asyncio.run(run()) == (False, "tpm")


def test_a_full_bucket_a_window_old_is_still_dropped() -> None:
    async def run() -> int:
        clock = Clock()
        lim = MemoryRateLimiter(clock=clock)
        limits = Limits(rpm=60, tpm=10_000)
        for i in range(limits_mod.MIN_SWEEP - 1):
            await lim.finish(await lim.admit(f"old-{i}", limits, tokens=10), 10)
        clock.now += limits_mod.WINDOW_S + 2.0
        await lim.finish(await lim.admit("new", limits, tokens=10), 10)  # the sweep
        return lim.tenants_tracked
    assert asyncio.run(run()) == 1
