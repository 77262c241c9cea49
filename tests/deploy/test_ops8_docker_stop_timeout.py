"""`docker stop` waits 10 s before SIGKILL; kvgate drains for `server.shutdown_grace_s` (30 s).
The documented `docker run` lines said nothing of it, so a stop cut every stream still running
after 10 s. Each one now passes a `--stop-timeout` above the drain (as the Kubernetes manifests
give the pod's terminationGracePeriodSeconds above it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.config import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "docs" / "deploy.md", ROOT / "Dockerfile"]


def _docker_runs(path: Path) -> list[str]:
    """Each `docker run` command, its continuation lines joined."""
    text = re.sub(r"\\\n#?\s*", " ", path.read_text())
    return [line for line in text.splitlines() if "docker run" in line]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_documented_docker_run_outlasts_the_drain(path: Path) -> None:
    runs = _docker_runs(path)
    assert runs, f"no docker run in {path.name}"
    grace = ServerConfig().shutdown_grace_s
    for run in runs:
        found = re.search(r"--stop-timeout[ =](\d+)", run)
        assert found, f"{path.name}: no --stop-timeout in {run.strip()!r}"
        assert int(found.group(1)) > grace, run
