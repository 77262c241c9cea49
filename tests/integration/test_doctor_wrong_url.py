"""`kvgate doctor --url` pointed at a vLLM replica (the same default port as the gateway's)
said "HTTP 404: Not Found (a kvgate gateway with `kvgate doctor` support?)": nothing on what
--url takes, as `kvgate admin` now says."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

from tests.support.procs import ROOT, Proc


def test_doctor_at_a_replica_says_what_url_takes(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, sim = sim_factory("--time-scale", "50")
    run = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "doctor", "--url", sim],
        cwd=ROOT, env={"PATH": "/usr/bin:/bin", "KVGATE_ADMIN_TOKEN": "t"},
        capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "not a kvgate gateway's answer; check --url: --url takes the gateway's port" in (
        run.stderr), run.stderr
    assert "Traceback" not in run.stderr
