"""docs/benchmarks.md says every benchmark command takes `--help`: each `python -m
loadtest.X` it names answers it with exit status 0 and names every flag the page shows for
it (`epp_reset_probe --help` exited 1: "usage: ..." as an error; with no argument it raised
IndexError)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "benchmarks.md").read_text()
COMMANDS = sorted(set(re.findall(r"python -m (loadtest\.[a-z_]+)", DOC)))


def _documented_flags(module: str) -> set[str]:
    shown = re.findall(rf"python -m {re.escape(module)}([^`|]*)", DOC)
    return {flag for text in shown for flag in re.findall(r"--[a-z][a-z-]*", text)}


def test_the_page_names_commands() -> None:
    assert "loadtest.epp_reset_probe" in COMMANDS and len(COMMANDS) > 10


@pytest.mark.parametrize("module", COMMANDS)
def test_each_command_answers_help_with_the_documented_flags(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()
    missing = sorted(f for f in _documented_flags(module) if f not in done.stdout)
    assert missing == []


def test_the_probe_without_arguments_prints_its_usage() -> None:
    done = subprocess.run([sys.executable, "-m", "loadtest.epp_reset_probe"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "usage:" in done.stderr and "Traceback" not in done.stderr
