"""A lower band's minimum share when its next request is large: it is owed once its credit
covers the request or `OWED_CAP` tokens, whichever is less, and pays the rest as a debt
it works off before its next turn (kept while the band is empty, forgiven once it is the
top band: nothing then competes with it).

It was owed only once its credit covered the whole request: a 100,000-token free prompt
behind a premium backlog waited for 1,000,000 premium tokens at a floor of 0.1 (longer than
any `max_wait_s` of a small pool), was shed, and its band's credit went with the empty
band, so its retry started from nothing again: never served while premium stayed busy.
"""

from __future__ import annotations

import math

from routing.flow.queue import OWED_CAP, FlowQueue

PREMIUM = 1_000  # tokens per premium request
HUGE = 100_000


def _premium(q: FlowQueue[str], n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        q.offer(f"p{i}", tenant="p", band=0, cost=PREMIUM, now=0, max_wait_s=1e9)


def _pops_until(q: FlowQueue[str], handle: str, most: int) -> int | None:
    """How many pops until ``handle`` goes (None: not within ``most``)."""
    for n in range(1, most + 1):
        e = q.pop(0.0)
        if e is not None and e.handle == handle:
            return n
    return None


def test_a_huge_lower_band_request_goes_once_its_band_earned_the_cap() -> None:
    q: FlowQueue[str] = FlowQueue(100_000, min_share={1: 0.1})
    _premium(q, 2_000)
    q.offer("huge", tenant="f", band=1, cost=HUGE, now=0, max_wait_s=1e9)
    # the cap's worth of credit at 0.1 of each premium request: OWED_CAP / 100 of them
    n = _pops_until(q, "huge", 1_000)
    assert n is not None, "still waiting for a million premium tokens"
    assert n == math.ceil(OWED_CAP / (PREMIUM / 10)) + 1


def test_the_debt_is_worked_off_before_the_band_goes_again() -> None:
    """The band's next request waits until the debt and that request are earned: over the
    run the band still gets its share, not more (its credit kept while it is empty)."""
    q: FlowQueue[str] = FlowQueue(100_000, min_share={1: 0.1})
    _premium(q, 3_000)
    q.offer("huge", tenant="f", band=1, cost=HUGE, now=0, max_wait_s=1e9)
    first = _pops_until(q, "huge", 1_000)
    assert first is not None
    q.offer("small", tenant="f", band=1, cost=PREMIUM, now=0, max_wait_s=1e9)  # band was empty
    later = _pops_until(q, "small", 3_000)
    assert later is not None
    premium_tokens = (first - 1 + later - 1) * PREMIUM
    # the band's 101,000 tokens are at most its 10 % floor of everything (plus one request)
    band = HUGE + PREMIUM
    assert band <= 0.1 * (premium_tokens + band) + PREMIUM


def test_a_band_with_nothing_above_it_owes_nothing() -> None:
    q: FlowQueue[str] = FlowQueue(100_000, min_share={1: 0.1})
    _premium(q, 200)
    q.offer("huge", tenant="f", band=1, cost=HUGE, now=0, max_wait_s=1e9)
    assert _pops_until(q, "huge", 1_000) is not None
    while q:  # premium drains; the free band alone is served at once
        q.pop(0.0)
    q.offer("next", tenant="f", band=1, cost=PREMIUM, now=0, max_wait_s=1e9)
    e = q.pop(0.0)
    assert e is not None and e.handle == "next"
    _premium(q, 50, start=1_000)  # premium back: the free band starts without a debt
    q.offer("again", tenant="f", band=1, cost=PREMIUM, now=0, max_wait_s=1e9)
    assert _pops_until(q, "again", 60) == 11  # 10 premium requests earn its 1,000 at 0.1
