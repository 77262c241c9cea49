"""`kvgate doctor` names today's replica states for what they are. A replica whose engine was
put to sleep (found through its dev-mode ``/is_sleeping``: run with ``--disable-log-stats``)
was "down: kvgate took it out of rotation" with "check its vLLM process, its host and the
network": nothing there is broken, it sleeps; the change is to wake it or take it out of the
pool. A frozen replica (SIGSTOP: one silent /health probe with requests waiting) is named
frozen, with where to look. Real gateways, real simulators, the CLI as a user runs it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

import httpx
import openai

from tests.support.frozen import ask_until_two_wait
from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import ROOT, Proc, sim_proc

MODEL = "sim-model"
ADMIN = "doctor5-states-admin-token-0123456789"  # tests only
FAST_DOCTOR = {"KVGATE_DOCTOR__INTERVAL_S": "0.1", "KVGATE_ADMIN_TOKEN": ADMIN}


def _doctor(base: str, *args: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "KVGATE_ADMIN_TOKEN": ADMIN}
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", "--url", base,
                           "--window", "1s", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _reason(base: str, replica: str) -> str:
    """Why `GET /admin/replicas` says ``replica`` is out ("" while it is in)."""
    listed = httpx.get(f"{base}/admin/replicas", timeout=10,
                       headers={"authorization": f"Bearer {ADMIN}"}).json()
    for pool in listed["data"]:
        for row in pool["replicas"]:
            if row["id"] == replica:
                return str(row["reason"] or "")
    return ""


def _down_finding(base: str, replica: str) -> dict[str, Any] | None:
    report = json.loads(_doctor(base, "--json"))
    found = [f for f in report["findings"] if f["replica"] == replica and f["class"] == "down"]
    return found[0] if found else None


def test_a_sleeping_replica_is_named_asleep(procs: list[Proc]) -> None:
    urls = []
    for _ in range(2):
        sim, url = sim_proc(None, "--time-scale", "20", "--disable-log-stats", model=MODEL)
        sim.env["VLLM_SERVER_DEV_MODE"] = "1"
        procs.append(sim.start())
        urls.append(url)
    gw, base = gateway_proc(upstreams=urls, env=FAST_DOCTOR)
    procs.append(gw.start())
    sleepy = urls[0].removeprefix("http://")
    assert httpx.post(f"{urls[0]}/sleep", params={"level": "1"}, timeout=10).status_code == 200
    wait_for(lambda: "asleep" in _reason(base, sleepy), timeout=30, what="found asleep")
    wait_for(lambda: _down_finding(base, sleepy) is not None, timeout=30, what="named down")
    finding = _down_finding(base, sleepy)
    assert finding is not None
    assert finding["summary"].startswith("replica asleep"), finding["summary"]
    assert finding["severity"] == "warning"
    assert "wake" in finding["action"] and "/wake_up" in finding["action"]
    assert "network" not in finding["action"]
    said = _doctor(base)
    assert "replica asleep" in said and "/is_sleeping" in said


def test_a_frozen_replica_is_named_frozen(procs: list[Proc]) -> None:
    urls, sims = [], []
    for _ in range(2):
        sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(sim.start())
        sims.append(sim)
        urls.append(url)
    gw, base = gateway_proc(upstreams=urls, env={
        **FAST_DOCTOR, "KVGATE_HEALTH__INTERVAL_S": "0.5", "KVGATE_HEALTH__TIMEOUT_S": "1",
        "KVGATE_HEALTH__SLOW_THRESHOLD": "1000", "KVGATE_HEALTH__EJECT_BASE_S": "30",
        "KVGATE_HEALTH__EJECT_MAX_S": "60", "KVGATE_ROUTING__POLICY": "round_robin",
        "KVGATE_ROUTING__SILENT_MIN_S": "0"})
    procs.append(gw.start())
    frozen = urls[0].removeprefix("http://")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    sims[0].signal(signal.SIGSTOP)
    try:
        ask_until_two_wait(client, base, frozen, MODEL, "frozen")
        wait_for(lambda: "no answer from it" in _reason(base, frozen), timeout=30,
                 what="found frozen")
        wait_for(lambda: _down_finding(base, frozen) is not None, timeout=30,
                 what="named down")
        finding = _down_finding(base, frozen)
        assert finding is not None
        assert finding["summary"].startswith("replica frozen"), finding["summary"]
        assert finding["severity"] == "critical"
        assert "SIGSTOP" in finding["action"]
    finally:
        sims[0].signal(signal.SIGCONT)
