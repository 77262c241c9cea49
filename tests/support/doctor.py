"""Ask `kvgate doctor` about a window that lies inside a scenario's load.

A report asked after the load covers the load's end too: on a loaded machine the load's
teardown and the report's own wait are a good part of a 5 s window, with nothing in flight
there. The rules judged on the window's means (the mean in flight against flow control's
bound) then read a saturated pool as one with room. Here the report is asked while the load
still runs, once the window fits inside it.
"""

from __future__ import annotations

from typing import Any

from loadtest.doctor_load import LoadResult
from loadtest.doctor_scenarios import Running

__all__ = ["report_during_load"]


def report_during_load(
    run: Running, window_s: float, settle_s: float = 1.0, spare_s: float = 3.0
) -> tuple[list[LoadResult], dict[str, Any]]:
    """Run the load for ``settle_s + window_s + spare_s`` and ask the report of the last
    ``window_s`` once that much of it ran after ``settle_s`` (the load reaching its steady
    state); ``spare_s`` is the load left for a late poll and the report's own wait."""
    reports: list[dict[str, Any]] = []

    def during(elapsed: float) -> None:
        # not past half the spare time: a poll after the load's end (the poller's last one)
        # would ask about the load's end again
        if settle_s + window_s <= elapsed < settle_s + window_s + spare_s / 2 and not reports:
            reports.append(run.report(window_s))

    results = run.run(settle_s + window_s + spare_s, during, poll_s=0.25)
    assert reports, "the load ended before the doctor was asked (a poll late by the spare time)"
    return results, reports[0]
