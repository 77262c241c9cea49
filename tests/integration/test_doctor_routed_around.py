"""`kvgate doctor` on a pool where cache_aware routes around a slow engine: one replica on the
simulator's A100-70B-AWQ preset (prefill and decode several times slower) beside two on the
default H100-8B-FP8, prompts of 1,500 uncached tokens. The router sent the slow one 3 of
1,811 requests and the doctor called every row healthy (the slow one "idle"), though the pool
ran on two replicas' capacity."""

from __future__ import annotations

import json

import pytest

from loadtest.doctor_load import Load
from loadtest.doctor_scenarios import A100, Running, Scenario

pytestmark = pytest.mark.slow


def test_a_slow_engine_the_router_avoids_is_named_with_its_speed() -> None:
    sc = Scenario("routed-around", "routing", "p", 0, {"p": [A100, [], []]},
                  {"p": Load("", 6, "long-unique", 1500, max_tokens=8)})
    with Running(sc, scale=20.0, thresholds={"overhead_p99_s": 0.1}) as run:
        (result,) = run.run(6.0)
        report = run.report(6.0)
        slow = run.urls["p"][0].removeprefix("http://")
    assert result.ok > 0
    said = json.dumps(report["findings"], indent=1)
    named = [f for f in report["findings"] if f["class"] != "healthy"]
    assert {f["replica"] for f in named} == {slow}, said  # its peers are fine
    # with 5 requests started there its own slow decode is judged too (decode-bound)
    assert {f["class"] for f in named} <= {"routing", "decode-bound"}, said
    (f,) = [f for f in named if f["class"] == "routing"]
    assert f["summary"].startswith(f"slow engine, routed around: {slow}'s engine is"), said
    ratio = f["evidence"][0]
    assert ratio["value"] >= ratio["threshold"] == 2.0
    assert "check its GPU" in f["action"]
