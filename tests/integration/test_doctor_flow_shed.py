"""`kvgate doctor` on a pool whose flow control sheds: `flow.max_inflight` 2 per replica and
`flow.max_queue` 0 (shed, never hold) under 24 concurrent clients. About nine requests in ten
were answered 503 and the doctor said every row was healthy ("routing: nothing above
thresholds (requests 1,975, 5xx 0, ...)"): the overload 503s are left out of the 5xx share
and nothing read `kvgate_flow_shed_total`."""

from __future__ import annotations

import json

import httpx
import pytest

from loadtest.doctor_load import Load
from loadtest.doctor_scenarios import ADMIN_TOKEN, Running, Scenario, _pool
from tests.support.doctor import report_during_load

pytestmark = pytest.mark.slow


def test_a_pool_shedding_in_flow_control_is_named_with_its_shed_count() -> None:
    sc = Scenario("shed", "queue-bound", "q", None, {"q": _pool([])},
                  {"q": Load("", 24, "short", max_tokens=200)},
                  flow={"max_inflight": 2, "max_queue": 0})
    with Running(sc, scale=20.0, thresholds={"overhead_p99_s": 0.1}) as run:
        # the window inside the load: after it, its idle end cut the mean in flight
        (result,), report = report_during_load(run, 5.0)
    shed = result.statuses.get(503, 0)
    assert shed > 0 and result.statuses.get(200, 0) > 0, result.statuses
    said = json.dumps(report["findings"], indent=1)
    pool = [f for f in report["findings"] if (f["pool"], f["replica"]) == ("q", None)]
    assert [f["class"] for f in pool] == ["queue-bound"], said
    (finding,) = pool
    assert "requests were shed by flow control" in finding["summary"], said
    share, count, requests = finding["evidence"][:3]
    assert share["metric"] == "kvgate_flow_shed_total" and share["value"] >= share["threshold"]
    # the window's shed count is the clients' 503s (the window may miss the load's first tick)
    assert 0 < count["value"] <= shed and count["value"] <= requests["value"]
    assert finding["severity"] == ("critical" if share["value"] >= 0.5 else "warning")
    assert finding["action"].startswith("raise flow.max_inflight (now 2)"), said


def test_a_pools_bound_set_in_the_policy_is_the_one_the_doctor_says_to_raise() -> None:
    """The policy's `pools.q.max_inflight` 2 holds the pool while the configuration's
    `flow.max_inflight` is 64: the doctor told to raise flow.max_inflight (now 64), a knob
    that bounds this pool no longer (or, under 3/4 of 64 in flight, no bound at all)."""
    sc = Scenario("shed-policy", "queue-bound", "q", None, {"q": _pool([])},
                  {"q": Load("", 24, "short", max_tokens=200)},
                  flow={"max_inflight": 64, "max_queue": 0})
    with Running(sc, scale=20.0, thresholds={"overhead_p99_s": 0.1}) as run:
        r = httpx.patch(f"{run.base}/admin/policy", timeout=10,
                        json={"pools": {"q": {"max_inflight": 2}}},
                        headers={"authorization": f"Bearer {ADMIN_TOKEN}",
                                 "content-type": "application/merge-patch+json"})
        assert r.status_code == 200, r.text
        (result,), report = report_during_load(run, 5.0)
    assert result.statuses.get(503, 0) > 0, result.statuses
    said = json.dumps(report["findings"], indent=1)
    (finding,) = [f for f in report["findings"] if (f["pool"], f["replica"]) == ("q", None)]
    assert finding["action"].startswith("raise pools.q.max_inflight in the policy (now 2)"), said
