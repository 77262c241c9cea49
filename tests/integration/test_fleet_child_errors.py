"""A child of `loadtest.fleet.Fleet` (the demo's and the benchmarks' replicas) that exits at
start is reported with what it said: `kvgate demo` printed only "kvgate sim exited with 2"."""

from __future__ import annotations

import pytest

from loadtest.fleet import Fleet


def test_a_child_that_exits_at_start_is_reported_with_its_last_words() -> None:
    with Fleet() as fleet, pytest.raises(RuntimeError) as info:
        fleet.sim("m", "--preset", "no-such-preset")
    assert "kvgate sim exited with 2" in str(info.value)
    assert "invalid choice: 'no-such-preset'" in str(info.value)
