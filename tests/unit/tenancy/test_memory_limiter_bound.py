"""`MemoryRateLimiter` keeps what it must for the tenants active within about a minute, not a
bucket for every tenant ever seen (removed tenants, keys used once), and dropping idle
buckets changes no decision (a settlement later than `KEEP_S` after its admission, on a
bucket dropped since, is not charged: `MemoryRateLimiter`'s docstring)."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.policy_doc import Limits
from gateway.tenancy import limits as limits_mod
from gateway.tenancy.limits import Admission, MemoryRateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("limits", [
    Limits(rpm=60, tpm=1000), Limits(rpm=60), Limits(tpm=1000),
    Limits(max_concurrency=2), Limits(rpm=60, tpm=1000, max_concurrency=2),
])
def test_tenants_seen_once_are_not_kept(limits: Limits) -> None:
    async def churn() -> int:
        clock = Clock()
        lim = MemoryRateLimiter(clock=clock)
        for i in range(20_000):  # each tenant seen once, ten a second
            a = await lim.admit(f"tenant-{i}", limits, tokens=10)
            await lim.finish(a, 12)
            clock.now += 0.1
        return lim.tenants_tracked
    assert asyncio.run(churn()) <= 2 * limits_mod.MIN_SWEEP


def _trace(
    min_sweep: int, monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[tuple[object, ...]], list[int]]:
    """Every admission's answer for one seeded random workload, and the tenants tracked."""
    monkeypatch.setattr(limits_mod, "MIN_SWEEP", min_sweep)
    rng = random.Random(7)
    clock = Clock()
    lim = MemoryRateLimiter(clock=clock)
    limits = Limits(rpm=30, tpm=2000, max_concurrency=2)
    out: list[tuple[object, ...]] = []
    tracked: list[int] = []

    async def run() -> None:
        held: list[Admission] = []
        for _ in range(5000):
            # three busy tenants that hit their limits, and many seen now and then
            clock.now += rng.expovariate(4.0)
            tenant = rng.randrange(3) if rng.random() < 0.5 else rng.randrange(3, 1000)
            a = await lim.admit(f"t{tenant}", limits, tokens=rng.randrange(1, 400))
            out.append((a.allowed, a.reason, a.remaining_requests, a.remaining_tokens,
                        round(a.retry_after_s, 6)))
            tracked.append(lim.tenants_tracked)
            held.append(a)
            if len(held) > 4 or rng.random() < 0.5:  # (usage within the reservation)
                done = held.pop(rng.randrange(len(held)))
                await lim.finish(done, rng.randrange(0, done.reserved_tokens + 1))
    asyncio.run(run())
    return out, tracked


def test_dropping_full_buckets_changes_no_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    never, kept = _trace(10**9, monkeypatch)
    swept, fewer = _trace(8, monkeypatch)  # sweeps from 8 buckets on
    assert swept == never
    denied = [reason for allowed, reason, *_ in never if not allowed]
    assert {"tpm", "concurrency"} <= set(denied)  # the limits were hit
    # kept: the tenants charged within `KEEP_S` (about 4 a second), at most twice them
    assert max(kept) > 900 and max(fewer) < 2 * 4 * limits_mod.KEEP_S
