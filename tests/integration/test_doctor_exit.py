"""`kvgate doctor`'s exit status for scripts: 0 whenever the report is printed, unless
``--fail-on SEVERITY`` asks for 3 when a finding is that severe or worse. A script checking a
fleet had exit 0 for a critical finding and nothing to ask for another status."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest

from loadtest.doctor_load import Load
from loadtest.doctor_scenarios import ADMIN_TOKEN, Running, Scenario, _pool
from tests.support.procs import ROOT

pytestmark = pytest.mark.slow


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    return subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def _severities(run: Running) -> set[str]:
    return {f["severity"] for f in run.report(5.0)["findings"]}


def test_fail_on_exits_3_for_a_finding_that_severe_and_0_otherwise() -> None:
    sc = Scenario("exit", "healthy", "p", None, {"p": _pool([], 2)},
                  {"p": Load("", 2, "short", max_tokens=16)})
    with Running(sc, scale=4.0, thresholds={"overhead_p99_s": 0.1}) as run:
        run.run(3.0)
        assert _severities(run) == {"ok"}, run.report(5.0)["findings"]
        for flags, code in (([], 0), (["--fail-on", "info"], 0), (["--fail-on", "critical"], 0)):
            done = _cli("--url", run.base, "--window", "5s", *flags)
            assert (done.returncode, done.stderr) == (code, ""), flags
            assert "worst: ok" in done.stdout
        # one replica's engine dies (/health 503): kvgate ejects it, the doctor says critical
        httpx.post(f"{run.urls['p'][0]}/sim/faults", json={"dead": True},
                   timeout=5).raise_for_status()
        deadline = time.monotonic() + 30
        while "critical" not in _severities(run) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "critical" in _severities(run)
        for flags, code in (([], 0), (["--fail-on", "critical"], 3),
                            (["--fail-on", "warning"], 3), (["--json", "--fail-on", "info"], 3)):
            done = _cli("--url", run.base, "--window", "5s", *flags)
            assert (done.returncode, done.stderr) == (code, ""), flags
            assert "critical" in done.stdout  # the report is printed all the same
        machine = _cli("--url", run.base, "--window", "5s", "--json", "--fail-on", "critical")
        assert json.loads(machine.stdout)["worst"] == "critical"
    bad = _cli("--url", "http://127.0.0.1:9", "--fail-on", "fatal")
    assert bad.returncode == 2 and "--fail-on" in bad.stderr
