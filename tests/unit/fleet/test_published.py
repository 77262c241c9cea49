"""`PublishedLoad`: which of a gateway's own load the next batch carries."""

from __future__ import annotations

import pytest

from gateway.fleet.published import PublishedLoad
from routing.peers import ZERO, ReplicaLoad

ONE, TWO = ReplicaLoad(1, 1, 100, 100.0), ReplicaLoad(2, 1, 300, 150.0)
BEAT = 0.5


def _after_first(loads: dict[str, ReplicaLoad]) -> PublishedLoad:
    """A ledger whose first batch (a heartbeat) carried `loads` at t = 0."""
    ledger = PublishedLoad(BEAT)
    ledger.changes(loads, 0.0, routes=False)
    return ledger


@pytest.mark.parametrize(("before", "loads", "now", "routes", "expected"), [
    # the first batch is a heartbeat: every non-zero load, no zero never published
    (None, {"a": ONE, "b": ZERO}, 0.0, False, {"a": ONE}),
    # nothing changed within the heartbeat: no batch, unless routes go out
    ({"a": ONE}, {"a": ONE}, 0.1, False, None),
    ({"a": ONE}, {"a": ONE}, 0.1, True, {}),
    # a change goes out alone; a load gone to zero goes out as zero
    ({"a": ONE, "b": ONE}, {"a": TWO, "b": ONE}, 0.1, False, {"a": TWO}),
    ({"a": ONE}, {"a": ZERO}, 0.1, False, {"a": ZERO}),
    # a replica that left our pools is said gone
    ({"a": ONE, "b": ONE}, {"a": ONE}, 0.1, False, {"b": ZERO}),
    # the heartbeat repeats what peers hold
    ({"a": ONE, "b": ONE}, {"a": ONE, "b": ONE, "c": ZERO}, BEAT, False, {"a": ONE, "b": ONE}),
])
def test_changes(before: dict[str, ReplicaLoad] | None, loads: dict[str, ReplicaLoad],
                 now: float, routes: bool, expected: dict[str, ReplicaLoad] | None) -> None:
    ledger = PublishedLoad(BEAT) if before is None else _after_first(before)
    assert ledger.changes(loads, now, routes) == expected


def test_what_goes_out_is_what_peers_hold() -> None:
    ledger = _after_first({"a": ONE, "b": TWO})
    ledger.changes({"a": ZERO, "b": TWO}, 0.1, routes=False)
    assert ledger.published == {"b": TWO}


def test_after_an_outage_the_whole_load_goes_out_zeros_included() -> None:
    ledger = _after_first({"a": ONE})
    ledger.resend_all = True
    assert ledger.changes({"a": ONE, "b": ZERO}, 0.1, routes=False) == {"a": ONE, "b": ZERO}
    assert not ledger.resend_all
    assert ledger.changes({"a": ONE, "b": ZERO}, 0.2, routes=False) is None


def test_a_failed_batch_is_forgotten_and_the_next_one_beats() -> None:
    ledger = _after_first({"a": ONE})
    ledger.forget()
    assert ledger.published == {}
    assert ledger.changes({"a": ONE}, 0.1, routes=False) == {"a": ONE}


def test_heartbeats_and_resends_carry_the_whole_load_changes_do_not() -> None:
    ledger = _after_first({"a": ONE})
    assert ledger.whole  # the first batch is a heartbeat
    ledger.changes({"a": TWO}, 0.1, routes=False)
    assert not ledger.whole  # one change: the others are left as they were
    ledger.changes({"a": TWO}, BEAT, routes=False)
    assert ledger.whole
    ledger.resend_all = True
    ledger.changes({"a": TWO}, BEAT + 0.1, routes=False)
    assert ledger.whole
