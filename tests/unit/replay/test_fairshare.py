"""The fair-share yardstick: max-min shares capped by demand, window by window."""

from __future__ import annotations

import pytest

from loadtest.replay.fairshare import FairShareMeter, max_min

KEY = ("gw-0", 1)


def test_max_min_gives_a_light_tenant_what_it_asked_and_the_rest_by_weight() -> None:
    assert max_min(100, {"a": 10, "b": 500, "c": 500}, {}) == pytest.approx(
        {"a": 10, "b": 45, "c": 45})
    assert max_min(90, {"a": 500, "b": 500}, {"a": 2.0}) == pytest.approx({"a": 60, "b": 30})
    assert max_min(100, {"a": 30, "b": 20}, {}) == pytest.approx({"a": 30, "b": 20})


def test_a_tenant_that_asked_for_less_than_its_share_is_not_unfairly_served() -> None:
    """Whole-run token shares would call a 1:9 split unfair; a light tenant served all it
    asked for is exactly fair, and so is the heavy one given the rest."""
    m = FairShareMeter(window_s=10)
    m.queued(KEY, "light", 100, 1.0, 0.0)
    m.queued(KEY, "heavy", 5000, 1.0, 0.0)
    m.released(KEY, "light", 100, 1.0)
    m.released(KEY, "heavy", 900, 2.0)
    assert m.ratios() == {"heavy": 1.0, "light": 1.0}


def test_a_tenant_kept_waiting_while_another_is_served_is_owed_in_every_window() -> None:
    m = FairShareMeter(window_s=10)
    m.queued(KEY, "a", 1000, 1.0, 0.0)
    m.queued(KEY, "b", 1000, 1.0, 0.0)
    m.released(KEY, "a", 500, 1.0)  # window 1: a gets it all, b (waiting) nothing
    m.released(KEY, "a", 500, 11.0)  # window 2: again
    m.released(KEY, "b", 1000, 21.0)  # window 3: b alone asks: nothing to judge
    ratios = m.ratios()
    assert ratios["a"] == 2.0 and ratios["b"] == 0.0
