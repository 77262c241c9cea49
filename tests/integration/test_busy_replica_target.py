"""Issue 10's targets for a bad replica among three, as `loadtest/bench_busy.py` measures them
(a shorter run: 300 requests per policy instead of 1,500): at most 1 % of the requests fail,
for every policy, when one replica answers vLLM's busy 503 at once (`--max-num-queued-reqs 2`,
faults 1) and when it answers 500 on 30 % of its requests (faults 7). Before the fixes,
least_load lost ~12 % (busy) and every policy 6-11 % (500s)."""

from __future__ import annotations

import argparse

import pytest

from loadtest.bench_busy import POLICIES, run
from tests.support.procs import ROOT


@pytest.mark.parametrize("scenario", ["busy", "error500"])
def test_at_most_one_percent_fails_for_every_policy(scenario: str) -> None:
    args = argparse.Namespace(requests=300, concurrency=32, time_scale=10.0, scenario=scenario,
                              source=str(ROOT), policies=POLICIES)
    rows = run(args)
    assert [r["policy"] for r in rows] == list(POLICIES)
    worst = {str(r["policy"]): (r["failed_pct"], r["statuses"]) for r in rows
             if float(str(r["failed_pct"])) > 1.0}
    assert not worst, f"more than 1 % failed: {worst}"
    if scenario == "busy":  # the busy replica does not attract the traffic
        assert all(int(str(r["served_by_busy_replica"])) < 30 for r in rows), rows
