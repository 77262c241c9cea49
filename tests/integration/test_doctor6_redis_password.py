"""KVGATE_REDIS_URL with a password for a Redis that has none (no requirepass): the tenancy
store serves while Redis refuses the shared routing state ("AUTH ... called without any
password configured"). `/readyz` names it; `kvgate doctor` must say the same cause and its
change (remove the password from the URL, or set requirepass), not a generic refusal that sends
the operator to the log. A real redis-server, a real gateway, the doctor's CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import httpx

from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import ROOT, Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "doctor6-nopass-admin-token-0123456789"  # tests only
PASSWORD = "doctor6-unneeded-password"  # tests only


def test_the_doctor_names_a_password_redis_does_not_want(
        sim_factory: SimFactory, procs: list[Proc]) -> None:
    _, sim = sim_factory("--time-scale", "50")
    redis, url = redis_proc()
    procs.append(redis.start())
    gw, base = gateway_proc(upstreams=[sim], auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
        "KVGATE_DOCTOR__INTERVAL_S": "0.1",
        "KVGATE_REDIS_URL": url.replace("redis://", f"redis://:{PASSWORD}@")})
    procs.append(gw.start())
    wait_for(lambda: "requirepass" in str(httpx.get(f"{base}/readyz", timeout=10).json()
                                          .get("sync", {}).get("reason") or ""),
             timeout=30, what="sync.reason")
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", "--url", base,
                           "--window", "5s", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "KVGATE_ADMIN_TOKEN": ADMIN})
    assert done.returncode == 0, done.stdout + done.stderr
    assert PASSWORD not in done.stdout
    findings = json.loads(done.stdout)["findings"]
    first = findings[0]
    assert first["class"] == "gateway" and first["severity"] != "ok", findings
    assert "requirepass" in first["summary"] + first["action"], first
    assert "remove the password" in first["action"], first
