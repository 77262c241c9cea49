"""`kvgate doctor` on a tenant held back by its own rate limit: its tier allows 60 requests a
minute and its four clients send many times that. kvgate answered nine requests in ten 429
before any pool saw them, and the doctor said every row was healthy: nothing it read counted
the rate limiter's refusals. It must name the tenant's limit, as configured behaviour (info),
and blame nothing in the fleet."""

from __future__ import annotations

import json

import pytest

from loadtest.doctor_scenarios import SCENARIOS, Running, wrong_classes
from tests.support.doctor import report_during_load

pytestmark = pytest.mark.slow


def test_a_tenant_over_its_rpm_is_named_for_its_limit_not_the_fleet() -> None:
    sc = SCENARIOS["rate-limited"]
    with Running(sc, scale=4.0, thresholds={"overhead_p99_s": 0.1}) as run:
        (result,), report = report_during_load(run, 4.0, settle_s=0.5)
    assert result.statuses.get(429, 0) > result.statuses.get(200, 0) > 0, result.statuses
    said = json.dumps(report["findings"], indent=1)
    assert wrong_classes(report, sc, (None, None)) == [], said
    (finding,) = [f for f in report["findings"] if f["class"] == "limits"]
    assert finding["severity"] == "info" and (finding["pool"], finding["replica"]) == (None, None)
    assert finding["summary"].startswith("tenant t1: "), said
    assert "own rate limit (rpm, tier default)" in finding["summary"], said
    assert "kvgate admin tenants update t1 --rpm N" in finding["action"], said
    share, refused, answered = finding["evidence"]
    assert share["metric"] == "kvgate_ratelimit_rejections_total"
    assert share["value"] >= share["threshold"] == report["thresholds"]["limited_share"]
    assert 0 < refused["value"] <= result.statuses[429]
    assert 0 < answered["value"] <= result.statuses[200]
