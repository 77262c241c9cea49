"""`python -m loadtest.bench_sync --out DIR` writes its report and plot there, not over the
committed results."""

from __future__ import annotations

from pathlib import Path

from loadtest import bench_sync


def test_the_offline_report_goes_where_out_says(tmp_path: Path) -> None:
    committed = bench_sync.RESULTS / "bench_sync_offline.md"
    before = committed.stat().st_mtime_ns if committed.exists() else None
    assert bench_sync.main(["--offline", "--quick", "--out", str(tmp_path / "r")]) == 0
    report = (tmp_path / "r" / "bench_sync_offline.md").read_text()
    assert report.startswith("# Shared routing state: benchmark")
    assert "<r>" in report and str(tmp_path) not in report  # no machine path in the report
    assert (tmp_path / "r" / "bench_sync_offline.png").stat().st_size > 0
    after = committed.stat().st_mtime_ns if committed.exists() else None
    assert after == before
