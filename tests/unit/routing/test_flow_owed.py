"""`FlowQueue.owed`: which band below the top one is owed its minimum share now -- what the
gateway reads to stop holding that band for other gateways' top band once it has waited two
of their records' lags (`gateway.flow.gate.FlowGate._held_above`)."""

from __future__ import annotations

from routing.flow import FlowQueue


def test_a_lower_band_is_owed_once_its_credit_covers_its_next_request() -> None:
    q: FlowQueue[str] = FlowQueue(100, min_share={1: 0.5})
    assert q.owed() is None  # empty
    q.offer("free", tenant="f", band=1, cost=100, now=0, max_wait_s=60)
    assert q.owed() is None  # alone, the free band is the top band: nothing to make up for
    for i in range(3):
        q.offer(f"prem{i}", tenant="p", band=0, cost=100, now=0, max_wait_s=60)
    assert q.owed() is None  # no credit yet
    assert (e := q.pop(1.0, upto=0)) is not None and e.handle == "prem0"
    assert q.owed() is None  # half a request's credit
    assert (e := q.pop(1.0, upto=0)) is not None and e.handle == "prem1"
    assert q.owed() == 1  # its credit covers its next request
    assert (e := q.pop(1.0)) is not None and e.handle == "free"  # its turn, when not held
    assert q.owed() is None


def test_an_owed_band_stays_owed_while_it_is_held() -> None:
    q: FlowQueue[str] = FlowQueue(100, min_share={2: 0.9})
    q.offer("low", tenant="l", band=2, cost=100, now=0, max_wait_s=60)
    q.offer("mid", tenant="m", band=1, cost=100, now=0, max_wait_s=60)
    for i in range(4):
        q.offer(f"top{i}", tenant="t", band=0, cost=100, now=0, max_wait_s=60)
    for _ in range(2):
        q.pop(1.0, upto=0)
    assert q.owed() == 2  # the lowest band, owed; the middle one has no floor of its own
    q.pop(1.0, upto=0)
    assert q.owed() == 2  # held back, it keeps its credit
