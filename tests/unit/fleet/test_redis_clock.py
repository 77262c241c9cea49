"""`RedisClock`: Redis's clock learned from our own writes' ids, the best round trip winning."""

from __future__ import annotations

import pytest

from gateway.fleet.redis_clock import WINDOW, RedisClock


class Now:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_no_lag_before_a_write_taught_the_offset() -> None:
    assert RedisClock(Now(5.0)).lag(1_000) is None


@pytest.mark.parametrize("reply", [None, b"", b"abc-0", "1000-0", ValueError("OOM")])
def test_a_reply_that_is_not_an_id_teaches_nothing(reply: object) -> None:
    clock = RedisClock(Now(5.0))
    clock.sample(4.0, 4.1, reply)
    assert clock.lag(1_000) is None


# (samples as (sent, received, Redis's ms in the id), read at, entry's ms, lag expected)
CASES = [
    # Redis's clock 1,000 s ahead of our monotonic clock; one sample, a zero round trip
    ([(10.0, 10.0, 1_010_000)], 10.25, 1_010_000, 0.25),
    # the shortest round trip wins: the slow sample's middle is 50 ms off
    ([(10.0, 10.2, 1_010_000), (11.0, 11.0, 1_011_000)], 12.0, 1_011_900, 0.1),
    ([(11.0, 11.0, 1_011_000), (10.0, 10.2, 1_010_000)], 12.0, 1_011_900, 0.1),
    # an entry written after "now" by the estimate (within the error): never negative
    ([(10.0, 10.0, 1_010_000)], 10.0, 1_010_005, 0.0),
    # Redis's clock behind ours: the offset is negative, the lag the same
    ([(5_000.0, 5_000.0, 1_000_000)], 5_002.0, 1_000_500, 1.5),
]


@pytest.mark.parametrize(("samples", "at", "written_ms", "expected"), CASES)
def test_lag_on_redis_clock(samples: list[tuple[float, float, int]], at: float,
                            written_ms: int, expected: float) -> None:
    now = Now(0.0)
    clock = RedisClock(now)
    for sent, received, ms in samples:
        clock.sample(sent, received, b"%d-3" % ms)
    now.t = at
    lag = clock.lag(written_ms)
    assert lag == pytest.approx(expected, abs=1e-9)


def test_old_samples_leave_the_window() -> None:
    """A good sample of another Redis (restarted elsewhere, its clock 1 s apart) stops
    counting once `WINDOW` newer writes came back, even slower ones."""
    now = Now(0.0)
    clock = RedisClock(now)
    clock.sample(10.0, 10.0, b"1010000-0")
    for i in range(WINDOW):
        t = 20.0 + i
        clock.sample(t, t + 0.002, b"%d-0" % (1_021_000 + i * 1000 + 1))
    now.t = 100.0  # Redis's time 1,101.0005 by the new samples, 1,100.0005 by the old one
    lag = clock.lag(1_100_000)
    assert lag == pytest.approx(1.0, abs=1e-9)


def test_a_forgotten_clock_learns_the_new_server_alone() -> None:
    """A fresh Redis on a clock ten minutes behind: its first sample, slower (a new
    connection), must not lose to the old server's."""
    now = Now(10.0)
    clock = RedisClock(now)
    clock.sample(9.0, 9.001, b"1600000-0")  # the old server: Redis's 1600 s at our 9 s
    clock.forget()
    assert clock.lag(1_000_000) is None
    clock.sample(9.5, 9.7, b"1000600-0")  # the new one: 1000.6 s at our 9.6 s
    lag = clock.lag(1_001_000)
    assert lag is not None and lag < 1.0
