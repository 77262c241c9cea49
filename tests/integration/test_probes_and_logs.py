"""What Kubernetes' probes and an operator's log see of a gateway whose Redis and replicas are
all down: the manifests' liveness path answers (a restart would cure neither; the path the
manifests call was `/healthz` only, and `/livez`, which Kubernetes users expect, a 404), their
readiness path does not, and at `--log-level debug` the log holds kvgate's lines, not
redis-py's (it said "Failed to enable maintenance notifications" for each connection)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import yaml

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import ROOT, free_port, redis_proc


def _probe_paths() -> tuple[str, str]:
    """(liveness, readiness) paths of the kvgate container in deploy/base."""
    docs = list(yaml.safe_load_all((ROOT / "deploy/base/deployment.yaml").read_text()))
    (dep,) = [d for d in docs if d and d.get("kind") == "Deployment"]
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "kvgate"]
    return c["livenessProbe"]["httpGet"]["path"], c["readinessProbe"]["httpGet"]["path"]


def test_liveness_holds_while_redis_and_every_replica_are_down() -> None:
    live, ready = _probe_paths()
    assert live == "/livez"
    admin_port = free_port()
    config: dict[str, Any] = {"pools": {"p": {"served_model": "m",
                                              "replicas": ["http://127.0.0.1:9"]}}}
    env = {"KVGATE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",  # nothing listens
           "KVGATE_SERVER__ADMIN_PORT": str(admin_port)}
    gw, base = gateway_proc(config=config, env=env, ready=False)
    with gw:
        for at in (base, f"http://127.0.0.1:{admin_port}"):
            alive = httpx.get(f"{at}{live}", timeout=5)
            assert (alive.status_code, alive.json()) == (200, {"status": "ok"}), at
            assert httpx.head(f"{at}{live}", timeout=5).status_code == 200
            readiness = httpx.get(f"{at}{ready}", timeout=5)
            assert readiness.status_code == 503, readiness.text
            assert readiness.json()["pools"] == "not ready"
        assert httpx.get(f"{base}{live}/", timeout=5).status_code == 200  # as /healthz/
        assert httpx.post(f"{base}{live}", timeout=5).status_code == 405


def test_redis_py_stays_out_of_a_debug_log() -> None:
    redis, url = redis_proc()
    config: dict[str, Any] = {"pools": {"p": {"served_model": "m",
                                              "replicas": ["http://127.0.0.1:9"]}}}
    gw, base = gateway_proc(config=config, env={"KVGATE_REDIS_URL": url}, ready=False,
                            args=["--log-level", "debug"])
    with redis, gw:
        for _ in range(5):  # connections of the store, the limiter and the sharing opened
            httpx.get(f"{base}/readyz", timeout=5)
        # kvgate's own debug lines (the dead replica's failed scrapes) are there
        wait_for(lambda: '"level":"debug","logger":"gateway.' in gw.output(), timeout=20,
                 what="a debug line of kvgate's")
        gw.stop()
        docs = [orjson.loads(line) for line in gw.output(tail=None).splitlines()
                if line.startswith("{")]
    assert any(d["logger"] == "gateway.fleet.sync" for d in docs)  # Redis was used
    library = [d["msg"] for d in docs if d["logger"].split(".")[0] == "redis"]
    assert library == []
