"""`routing.flow.unseen`: other gateways' sends not seen yet, counted as this gateway's own
within the records' lag."""

from __future__ import annotations

from routing.flow import Saturation, pool_saturated
from routing.flow.unseen import UnseenPicks
from routing.peers import ReplicaLoad
from routing.types import ReplicaView


def _view(rid: str, inflight: int) -> ReplicaView:
    return ReplicaView(id=rid, pool="p", healthy=True, inflight=inflight)


def test_own_picks_within_the_window_count_once_more_per_other_gateway() -> None:
    unseen = UnseenPicks(window=0.1)
    unseen.picked("a", 100, now=1.0)
    unseen.picked("a", 50, now=1.05)
    unseen.picked("b", 10, now=1.05)
    totals = {"a": ReplicaLoad(1, 0, 0), "c": ReplicaLoad(2, 1, 7)}
    out = unseen.loads(totals, others=2, now=1.06)
    assert out["a"] == ReplicaLoad(1 + 4, 4, 300)
    assert out["b"] == ReplicaLoad(2, 2, 20)
    assert out["c"] == totals["c"]
    assert totals == {"a": ReplicaLoad(1, 0, 0), "c": ReplicaLoad(2, 1, 7)}  # not changed
    later = unseen.loads(totals, others=2, now=1.1)  # the first pick's window has passed
    assert later["a"] == ReplicaLoad(1 + 2, 2, 100)


def test_nothing_is_added_alone_outside_the_window_or_without_a_window() -> None:
    totals = {"a": ReplicaLoad(1, 0, 0)}
    unseen = UnseenPicks(window=0.1)
    unseen.picked("a", 100, now=1.0)
    assert unseen.loads(totals, others=0, now=1.0) is totals
    assert unseen.loads(totals, others=1, now=1.2) is totals
    off = UnseenPicks()
    off.picked("a", 100, now=1.0)
    assert len(off) == 0 and off.loads(totals, others=1, now=1.0) is totals


def test_two_gateways_fill_the_bound_between_them_not_twice_it() -> None:
    """Each gateway admits against the replica's bound with its own picks counted twice: of
    a bound of 4 with nothing seen of the peer, it takes 2; the peer, alike, the other 2."""
    rule = Saturation(max_inflight=4)
    unseen = UnseenPicks(window=0.1)
    own = 0
    while not pool_saturated([_view("a", own)], rule, unseen.loads({}, 1, 1.0)):
        own += 1
        unseen.picked("a", 0, now=1.0)
    assert own == 2
