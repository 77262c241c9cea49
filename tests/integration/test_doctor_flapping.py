"""A replica flapping up and down (its engine dying and coming back every few seconds) is
named: it was out of rotation a third of the window and back at the report, so neither of
*down*'s rules fired (out half the window, or out now) and its row said healthy.

Real gateway and simulators; the flaps are the simulator's ``dead`` fault switched on for
0.5 s and off for 2 s, four times, while a light load runs.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from loadtest.doctor_load import Load
from loadtest.doctor_scenarios import Running, Scenario, _pool

pytestmark = pytest.mark.slow

DOWN_S, UP_S, FLAPS = 0.5, 2.0, 4
WINDOW_S = 12.0


def _row(report: dict[str, Any], rid: str) -> dict[str, Any]:
    return next(r for r in report["replicas"] if r["id"] == rid)


def test_a_replica_flapping_up_and_down_is_named_for_it() -> None:
    sc = Scenario("flapping", "down", "p", 0, {"p": _pool([], 2)},
                  {"p": Load("", 2, "short", max_tokens=16)})
    with Running(sc, scale=20.0, thresholds={"overhead_p99_s": 0.1}) as run:
        url = run.urls["p"][0]
        rid = url.removeprefix("http://")
        cycle = DOWN_S + UP_S

        def flap(elapsed: float) -> None:
            dead = elapsed < FLAPS * cycle and elapsed % cycle < DOWN_S
            httpx.post(f"{url}/sim/faults", json={"dead": dead}, timeout=5).raise_for_status()

        run.run(FLAPS * cycle + 1.0, flap, poll_s=0.05)
        httpx.post(f"{url}/sim/faults", json={"dead": False}, timeout=5).raise_for_status()
        deadline = time.monotonic() + 30  # back in rotation (its health checks pass again)
        while (report := run.report(WINDOW_S)) and _row(report, rid)["healthy_last"] != 1.0:
            assert time.monotonic() < deadline, _row(report, rid)
            time.sleep(0.25)
    said = json.dumps(report["findings"], indent=1)
    (f,) = [f for f in report["findings"] if f["replica"] == rid]
    assert (f["class"], f["severity"]) == ("down", "warning"), said
    assert _row(report, rid)["outages"] >= 3, _row(report, rid)
    assert "it flaps" in f["summary"] and "back now" in f["summary"], said
    assert f["action"].startswith("it flaps: check whether its vLLM process restarts"), said
    other = run.urls["p"][1].removeprefix("http://")
    assert [g["class"] for g in report["findings"] if g["replica"] == other] == ["healthy"]
