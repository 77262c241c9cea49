"""The fleet size the workers saw, on disk: the largest any worker wrote is what a worker
started again during a Redis outage divides by; a file that holds no number is skipped."""

from __future__ import annotations

from pathlib import Path

from gateway.tenancy.fleet_seen import FleetSeen


def test_a_restarted_worker_recalls_the_largest_fleet_its_siblings_saw(tmp_path: Path) -> None:
    assert FleetSeen(tmp_path, 0).recall() is None  # nobody wrote yet
    FleetSeen(tmp_path, 0).keep(3)
    sibling = FleetSeen(tmp_path, 1)
    sibling.keep(5)
    sibling.keep(4)  # its window forgot the larger fleet: its file follows
    assert FleetSeen(tmp_path, 0).recall() == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fleet-seen-0", "fleet-seen-1"]


def test_a_file_without_a_number_is_skipped(tmp_path: Path) -> None:
    FleetSeen(tmp_path, 0).keep(2)
    (tmp_path / "fleet-seen-1").write_text("garbage")
    (tmp_path / "fleet-seen-2").write_text("0")
    assert FleetSeen(tmp_path, 3).recall() == 2
