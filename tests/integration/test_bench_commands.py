"""The benchmark commands of the table in docs/benchmarks.md, as a new user first tries them:
`--help` prints the usage under the name the page gives and runs nothing; the default trace is in
the repository."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from loadtest import bench_flow, bench_replay
from tests.support.procs import ROOT

DOC_BENCHES = sorted(set(re.findall(r"`python -m loadtest\.(bench_\w+)",
                                    (ROOT / "docs" / "benchmarks.md").read_text())))


def test_the_docs_list_the_benchmarks() -> None:
    assert "bench_admin_writes" in DOC_BENCHES
    assert len(DOC_BENCHES) >= 10


@pytest.mark.parametrize("name", DOC_BENCHES)
def test_help_prints_the_usage_and_runs_nothing(name: str) -> None:
    result = subprocess.run([sys.executable, "-m", f"loadtest.{name}", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: python -m loadtest.{name} "), result.stdout[:200]
    assert "keys one by one" not in result.stdout  # bench_admin_writes ran with "--help"


def test_admin_writes_refuses_an_unknown_store() -> None:
    result = subprocess.run([sys.executable, "-m", "loadtest.bench_admin_writes", "mongo"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "invalid choice: 'mongo'" in result.stderr


def test_the_default_trace_ships_with_the_repository() -> None:
    for default in (bench_flow.DEFAULT_TRACE, bench_replay.DEFAULT_TRACE):
        assert default.is_file()
        assert default.resolve().is_relative_to(ROOT.resolve())
