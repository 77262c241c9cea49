"""A replica's Retry-After: what it sets of the replica's busy back-off and of the client's
Retry-After (`gateway.verdicts`), table-driven, time passed in."""

from __future__ import annotations

import pytest

from gateway.replicas import HealthRules, Replica
from gateway.verdicts import busy_wait, judge, relayed_retry_after, retry_seconds

BUSY = HealthRules(busy_backoff_s=0.25, busy_backoff_max_s=2.0)
PAST = "Wed, 21 Oct 2015 07:28:00 GMT"  # an HTTP date, long past


@pytest.mark.parametrize(("sent", "seconds"), [
    ("5", 5), (" 7 ", 7), ("007", 7), ("99999999999", 3600), ("9" * 5000, 3600),
    ("0", None), ("00", None), (" 0 ", None),  # "at once": the usual back-off instead
    ("-1", None), ("-0", None), ("+3", None), ("1.5", None), ("soon", None), ("²", None),
    (PAST, None), ("", None), (None, None),
])
def test_retry_seconds(sent: str | None, seconds: int | None) -> None:
    assert retry_seconds(sent) == seconds


@pytest.mark.parametrize("sent", ["0", "-3", "garbage", PAST, None])
def test_a_429_saying_now_or_nothing_usable_gets_the_usual_back_off(sent: str | None) -> None:
    """A 429 with ``Retry-After: 0`` left the replica no back-off (picked again at once, in a
    loop while it refused) and told the client ``Retry-After: 0``."""
    r = Replica("p", "http://127.0.0.1:9001", BUSY)
    assert judge(r, 429, b"", 10.0, sent) == "busy"
    assert r.busy_until == 10.25 and not r.view(10.1).healthy
    assert busy_wait(r, sent, 10.0) == 1
    assert relayed_retry_after(429, sent, busy_wait(r, sent, 10.0)) == b"1"
    assert relayed_retry_after(503, sent) == b"1"
    assert judge(r, 429, b"", 10.3, sent) == "busy"  # it keeps refusing: the back-off doubles
    assert r.busy_until == pytest.approx(10.8)


def test_a_429s_positive_retry_after_is_its_back_off_and_the_clients_wait() -> None:
    r = Replica("p", "http://127.0.0.1:9001", BUSY)
    judge(r, 429, b"", 10.0, "1")
    assert r.busy_until == 11.0
    assert busy_wait(r, "1", 10.0) == 1 and relayed_retry_after(503, "1") == b"1"
