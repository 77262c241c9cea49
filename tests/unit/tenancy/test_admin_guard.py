"""The failed-admin-auth throttle: a bucket of failures per address, refilled over time."""

from __future__ import annotations

import pytest

from gateway.admin.guard import AuthGuard
from gateway.errors import RateLimited


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_address_is_throttled_after_its_burst_and_recovers_at_the_refill_rate() -> None:
    clock = Clock()
    guard = AuthGuard(burst=3, per_minute=6, clock=clock)  # one failure back every 10 s
    guard.check("10.0.0.1")
    assert [guard.failed("10.0.0.1", "invalid") for _ in range(3)] == [False, False, True]
    with pytest.raises(RateLimited) as err:
        guard.check("10.0.0.1")
    assert err.value.status == 429 and err.value.retry_after == 10
    assert err.value.message.endswith(  # a valid token is refused too: it says so
        "all admin requests from this address are refused for 10 s, valid tokens included")
    guard.check("10.0.0.2")  # other addresses are not affected
    clock.now += 10
    guard.check("10.0.0.1")  # one failure's worth refilled
    assert guard.failed("10.0.0.1", "invalid") is True  # ... and used up again
    assert guard.failures["invalid"] == 4 and guard.failures["throttled"] == 1


def test_tracked_addresses_are_bounded() -> None:
    guard = AuthGuard(burst=1, per_minute=1, max_addresses=2, clock=Clock())
    for address in ("a", "b", "c"):
        guard.failed(address, "missing")
    guard.check("a")  # forgotten (the oldest): not throttled any more
    with pytest.raises(RateLimited):
        guard.check("c")
