"""The Redis reachability log: the first failure at once, then a line a minute, then one on
recovery."""

from __future__ import annotations

import logging

import pytest

from gateway.tenancy.reachability import Reachability


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_one_line_then_one_a_minute_then_one_on_recovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.tenancy.reachability")
    clock = Clock()
    reach = Reachability("10.0.0.7:6380", retry_every_s=2, clock=clock)
    for _ in range(31):  # 60 s of retries every 2 s
        reach.failed("connection refused")
        clock.now += 2
    reach.failed("connection refused")
    clock.now += 5
    reach.answered()
    reach.answered()  # already up: nothing to say
    assert [r.getMessage() for r in caplog.records] == [
        "cannot reach Redis at 10.0.0.7:6380 (connection refused); retrying every 2 s",
        "still cannot reach Redis at 10.0.0.7:6380 (connection refused): 30 failed attempts "
        "in the last 60 s, down for 60 s",
        "Redis at 10.0.0.7:6380 answers again (down for 67 s, 32 failed attempts)",
    ]
    assert not reach.down


def test_another_user_of_redis_says_what_is_affected_through_its_own_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.fleet")
    clock = Clock()
    reach = Reachability("10.0.0.7:6380", retry_every_s=0.5, clock=clock,
                         subject="shared routing state",
                         logger=logging.getLogger("gateway.fleet.sync"))
    reach.failed("connection refused")
    clock.now += 3
    reach.answered()
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("gateway.fleet.sync", "shared routing state: cannot reach Redis at 10.0.0.7:6380 "
                               "(connection refused); retrying every 0.5 s"),
        ("gateway.fleet.sync", "shared routing state: Redis at 10.0.0.7:6380 answers again "
                               "(down for 3 s, 1 failed attempts)"),
    ]


def test_a_flapping_redis_is_a_line_a_minute_not_two_per_flap(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis paused 0.7 s every second (stalls, a proxy dropping connections): each flap was
    a warning and an info line. Outages that begin within a minute of the last line for their
    cause are counted into the next one, also when causes alternate; a new cause is said at
    once."""
    caplog.set_level(logging.INFO, logger="gateway.tenancy.reachability")
    clock = Clock()
    reach = Reachability("10.0.0.7:6380", retry_every_s=1, clock=clock)
    for i in range(65):  # 130 s: down 1 s, up 1 s
        reach.failed("timed out" if i % 2 == 0 or i < 2 else "connection reset by peer")
        clock.now += 1
        reach.answered()
        clock.now += 1
    reach.failed("server replied OOM")
    timed_out = "cannot reach Redis at 10.0.0.7:6380 (timed out); retrying every 1 s"
    reset = ("cannot reach Redis at 10.0.0.7:6380 (connection reset by peer); retrying every "
             "1 s; 2 short outages in the last 6 s not logged")
    back = "Redis at 10.0.0.7:6380 answers again (down for 1 s, 1 failed attempts)"
    flaps = "; 26 short outages in the last 54 s not logged"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [  # a warning per cause a minute, not two lines every 2 s
        timed_out, back, reset, back, timed_out + flaps, back, reset, back,
        timed_out + flaps, back, reset, back,
        "refused by Redis at 10.0.0.7:6380 (server replied OOM); retrying every 1 s; 1 short "
        "outages in the last 4 s not logged",
    ], lines
    assert reach.down


def test_a_flap_that_lasts_is_named_by_the_minute_line_and_so_is_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.tenancy.reachability")
    clock = Clock()
    reach = Reachability("10.0.0.7:6380", retry_every_s=2, clock=clock)
    reach.failed("connection refused")
    clock.now += 2
    reach.answered()
    clock.now += 8
    for _ in range(30):  # down again 10 s after the first line, for 60 s
        reach.failed("connection refused")
        clock.now += 2
    reach.answered()
    assert [r.getMessage() for r in caplog.records][2:] == [
        "still cannot reach Redis at 10.0.0.7:6380 (connection refused): 25 failed attempts "
        "in the last 60 s, down for 50 s",
        "Redis at 10.0.0.7:6380 answers again (down for 60 s, 30 failed attempts)",
    ]


def test_ops5_a_cause_of_another_kind_is_said_at_once_and_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis restarted with a password: refused connections, then NOAUTH at every retry. The
    refusal was only in the next minute's summary; it is said at once, and a cause that swings
    between two kinds is not a line per attempt."""
    caplog.set_level(logging.INFO, logger="gateway.tenancy.reachability")
    clock = Clock()
    reach = Reachability("10.0.0.7:6380", retry_every_s=2, clock=clock)
    reach.failed("connection refused")
    clock.now += 2
    reach.failed("connection refused")
    for cause in ["server replied NOAUTH: authentication required", "connection refused"] * 5:
        clock.now += 2
        reach.failed(cause)
    assert [r.getMessage() for r in caplog.records] == [
        "cannot reach Redis at 10.0.0.7:6380 (connection refused); retrying every 2 s",
        "now refused by Redis at 10.0.0.7:6380 (server replied NOAUTH: authentication "
        "required), after 2 failed attempts in 4 s; retrying every 2 s",
    ]
