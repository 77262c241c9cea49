"""`kvgate doctor` on a real gateway of `server.workers 2`: each request reaches one worker,
whose report covers its own requests and history only; the doctor asks until it has both
workers' reports and shows each, named (before, it showed whichever worker it reached)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest

from tests.support.gateway import gateway_proc
from tests.support.procs import ROOT, Proc

pytestmark = pytest.mark.slow

MODEL = "sim-model"
ADMIN = "doctor-workers-admin-token-0123456789"


def _doctor(base: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "KVGATE_ADMIN_TOKEN": ADMIN}
    return subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", "--url", base,
                           "--window", "30s", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=90)


def test_the_doctor_shows_every_workers_report(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    upstream = sim_factory("--time-scale", "50")[1]
    proc, base = gateway_proc(config={
        "pools": {"p": {"replicas": [upstream], "served_model": MODEL}},
        "models": {MODEL: {"default": "p"}},
        "server": {"workers": 2},
    }, env={"KVGATE_REDIS_URL": redis_url, "KVGATE_ADMIN_TOKEN": ADMIN})
    with proc:
        for i in range(10):  # a new connection each: the kernel spreads them over workers
            with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as fresh:
                answer = fresh.post(f"{base}/v1/chat/completions", timeout=30, json={
                    "model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                    "max_tokens": 2})
                assert answer.status_code == 200, answer.text
        one = httpx.get(f"{base}/admin/doctor", params={"window": "30s"}, timeout=30,
                        headers={"authorization": f"Bearer {ADMIN}"}).json()
        assert one["process"]["workers"] == 2 and one["process"]["worker"] in (0, 1), one

        text = _doctor(base)
        assert text.returncode == 0, text.stderr
        out = text.stdout
        assert "runs 2 worker processes" in out and "(2 of 2)" in out, out
        for slot in (0, 1):
            assert f"worker {slot} (pid " in out, out
        assert out.count("this worker's requests, routing, CPU and history only") == 2, out
        assert "did not answer" not in out

        machine = _doctor(base, "--json")
        assert machine.returncode == 0, machine.stderr
        both = json.loads(machine.stdout)
        assert both["object"] == "doctor.workers" and both["workers"] == 2, both
        assert both["missing"] == []
        assert sorted(r["process"]["worker"] for r in both["data"]) == [0, 1]
        assert len({r["process"]["pid"] for r in both["data"]}) == 2
        assert all(r["object"] == "doctor" for r in both["data"])

        cache = _doctor(base, "--cache")
        assert cache.returncode == 0 and cache.stdout.count("cache return over") == 2, cache
