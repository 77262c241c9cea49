"""A replica kvgate took out of rotation a moment ago (a frozen process: one `/health` probe
timed out) is too short a share of the window to be named down; its finding said "healthy:
idle: 2 requests started in the window" all the same, while `/admin/replicas` said ejected.
It stays `ok` (a blip is not a finding) but says it is out now, why, and when it would be named."""

from __future__ import annotations

from typing import Any

from gateway.doctor.replica_rules import classify_replica
from tests.unit.doctor.test_rules import CTX, TH, replica

FROZEN = "/health: no answer within 5 s"


def test_a_replica_just_ejected_is_not_reported_as_simply_healthy() -> None:
    busy: dict[str, Any]
    for busy in ({"requests": 2.0}, {}):  # idle, and busy enough to judge its engine
        out_now: dict[str, Any] = {"healthy_share": 0.9, "healthy_last": 0.0,
                                   "reason": FROZEN, **busy}
        (f,) = classify_replica(replica(**out_now), TH, CTX)
        assert (f.cls, f.severity) == ("healthy", "ok")
        assert f"out of rotation now ({FROZEN}), for 10% of the window" in f.summary, f.summary
        assert "named down from 20%" in f.summary


def test_a_replica_in_rotation_or_draining_says_nothing_of_it() -> None:
    kw: dict[str, Any]
    for kw in ({"healthy_last": 1.0}, {"healthy_last": 0.0, "draining": True}):
        args: dict[str, Any] = {"healthy_share": 0.9, **kw}
        (f,) = classify_replica(replica(**args), TH, CTX)
        assert f.cls == "healthy" and "out of rotation" not in f.summary, f.summary
