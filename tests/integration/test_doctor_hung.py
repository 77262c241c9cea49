"""`kvgate doctor` on a replica whose engine hangs (the simulator's `engine_hang`: no token for
any request, its counters frozen, /health and /metrics 200) before kvgate's stall detection
ejects it (`health.stall_after_s`, 60 s by default). It was reported as the pool's routing
imbalance ("mean in flight 5.8 vs a median of 0.0") and the replica itself as healthy, idle;
on a loaded host, where the engine hung before it scheduled its requests (all waiting, none
running), as queue-bound."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from loadtest.doctor_load import Load
from loadtest.doctor_scenarios import Running, Scenario, _pool

pytestmark = pytest.mark.slow

THRESHOLDS = {"overhead_p99_s": 0.1, "hung_s": 2.0}  # the test's hang lasts a few seconds


def test_a_hung_engine_still_in_rotation_is_named_down_not_a_routing_imbalance() -> None:
    sc = Scenario("hung", "down", "p", 0, {"p": _pool([], 3)},
                  {"p": Load("", 6, "short", max_tokens=64)})
    with Running(sc, scale=4.0, thresholds=THRESHOLDS) as run:
        hung = run.urls["p"][0]
        reports: list[dict[str, Any]] = []

        def during(elapsed: float) -> None:
            if elapsed >= 1.0 and not reports:
                httpx.post(f"{hung}/sim/faults", json={"engine_hang": True},
                           timeout=5).raise_for_status()
            if elapsed >= 6.0 and not reports:
                # asked while it hangs: the load itself ends only once kvgate's own stall
                # detection (health.stall_after_s, 60 s) ejects the replica and its requests
                # are retried elsewhere; a report asked then raced that ejection ("replica
                # stalled" on a loaded host, where it came a second or two after it)
                reports.append(run.report(5.0))

        results = run.run(7.0, during)
        assert all(r.ok > 0 for r in results), [r.statuses for r in results]
        (report,) = reports
    said = json.dumps(report["findings"], indent=1)
    target = hung.removeprefix("http://")
    mine = [f for f in report["findings"] if f["replica"] == target]
    assert [f["class"] for f in mine] == ["down"], said
    (finding,) = mine
    assert finding["severity"] == "critical"
    assert finding["summary"].startswith("engine hung:"), said
    assert "health.stall_after_s (60 s)" in finding["summary"]
    frozen = finding["evidence"][0]
    assert frozen["metric"] == "vllm:generation_tokens_total"
    assert frozen["value"] >= frozen["threshold"] == 2.0
    # its held requests are its fault, not the router's; its peers are fine
    others = [f for f in report["findings"] if f["replica"] != target]
    assert all(f["class"] == "healthy" for f in others), said
