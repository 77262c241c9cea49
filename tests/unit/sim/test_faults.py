"""Fault switches: validation and the per-prompt latency."""

from __future__ import annotations

import pytest

from loadtest.sim.faults import Faults


@pytest.mark.parametrize(
    ("latency", "jitter", "seed", "expected_s"),
    [
        (0, 0, 123, 0.0),
        (100, 0, 123, 0.1),
        (100, 100, 0, 0.1),  # fraction 0
        (100, 100, 500, 0.15),  # fraction 0.5
        (100, 100, 1999, 0.1999),  # the fraction is the seed modulo 1000
    ],
)
def test_delay_is_fixed_per_prompt(
    latency: float, jitter: float, seed: int, expected_s: float
) -> None:
    f = Faults(latency_ms=latency, latency_jitter_ms=jitter)
    assert f.delay_s(seed) == pytest.approx(expected_s)
    assert f.delay_s(seed) == f.delay_s(seed)


@pytest.mark.parametrize(
    "change",
    [{"latency_jitter_ms": -1}, {"latency_ms": -5}, {"error_rate": 2}, {"nope": 1}, {"dead": 1},
     {"health_latency_ms": -1}, {"drop_connections": 1}, {"engine_faulted": "yes"}],
)
def test_bad_updates_change_nothing(change: dict[str, object]) -> None:
    f = Faults(latency_ms=10)
    with pytest.raises(ValueError):
        f.update(change)
    assert f.latency_ms == 10 and f.latency_jitter_ms == 0
