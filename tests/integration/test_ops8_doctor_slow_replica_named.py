"""`kvgate doctor` on a pool where one replica's engine is 4x slower than its peers'
(`kvgate sim --slowdown 4`), under the default cache-aware routing: the warning names that
replica, with why (its TTFT and inter-token latency against its peers'), and the replica is
not also listed healthy.

Seen: beside "slow engine, routed around: <replica>'s engine is 3.8x slower ..." (or
"imbalance: time per request on <replica> ..."), the same replica's row read "healthy:
nothing above thresholds" or "healthy: idle" (the router sending it little): an operator
reading the table saw the slow replica called healthy."""

from __future__ import annotations

import json

import pytest

from loadtest.doctor_load import Load
from loadtest.doctor_scenarios import Running, Scenario
from tests.support.doctor import report_during_load

pytestmark = pytest.mark.slow

SLOW4 = Scenario("slow-engine-4x", "routing", "p", 0, {"p": [["--slowdown", "4"], [], []]},
                 {"p": Load("", 6, "short", max_tokens=64)})


def test_a_replica_4x_slower_is_named_with_why_and_not_called_healthy() -> None:
    with Running(SLOW4, scale=4.0, thresholds={"overhead_p99_s": 0.1}) as run:
        results, report = report_during_load(run, 8.0, settle_s=2.0)
        _, slow = run.target()
    assert all(r.failed == 0 for r in results), [r.statuses for r in results]
    said = json.dumps(report["findings"], indent=1)
    mine = [f for f in report["findings"] if f["replica"] == slow]
    warned = [f for f in mine if f["class"] == "routing" and f["severity"] == "warning"]
    assert len(warned) == 1, said
    text = warned[0]["summary"] + " " + warned[0]["action"]
    assert "slower than its peers" in text, said
    assert "TTFT" in text and "inter-token latency" in text, said
    assert not [f for f in mine if f["class"] == "healthy"], said
    # the fast replicas are no one's concern
    assert all(f["class"] == "healthy" for f in report["findings"]
               if f["pool"] == "p" and f["replica"] not in (slow, None)), said
