"""A Redis that runs but refuses kvgate's writes (out of memory under `noeviction`): /metrics
names the cause, and `kvgate doctor` names it and its fix instead of "restore Redis"."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import httpx
import redis

from gateway.tenancy.redis_conn import CAUSE_LABELS
from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import ROOT, Proc, redis_proc

ADMIN_TOKEN = "doctor-redis-admin-token-0123456789"  # tests only
OOM = '{cause="oom"}'


def _doctor(base: str, *args: str) -> str:
    env = {"PATH": "/usr/bin:/bin", "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", "--url", base,
                           "--window", "30s", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_redis_out_of_memory_is_named_on_metrics_and_by_the_doctor(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, sim = sim_factory("--time-scale", "50")
    store, url = redis_proc()
    with store:
        gw, base = gateway_proc(upstreams=[sim], env={
            "KVGATE_REDIS_URL": url, "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN})
        with gw, redis.Redis.from_url(url) as r:
            sync = metric_values(base, "kvgate_sync_down_cause")
            # every cause, none now
            assert len(sync) == len(CAUSE_LABELS) and set(sync.values()) == {0.0}
            assert set(metric_values(base, "kvgate_redis_down_cause").values()) == {0.0}
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", "1")  # every write refused: OOM
            chat = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2}
            assert httpx.post(f"{base}/v1/chat/completions", json=chat,
                              timeout=10).status_code == 200  # served on its own state
            wait_for(lambda: metric_values(base, "kvgate_sync_down_cause").get(OOM) == 1.0,
                     what="kvgate_sync_down_cause oom")
            assert metric_values(base, "kvgate_sync_up") == {"": 0.0}
            said = _doctor(base)
            assert "shared routing state degraded" in said and "out of memory (OOM" in said
            assert "raise Redis's maxmemory" in said and "restore Redis" not in said
            report = json.loads(_doctor(base, "--json"))
            (finding,) = [f for f in report["findings"]
                          if f["evidence"] and f["evidence"][0]["metric"] == "kvgate_sync_up"]
            assert finding["severity"] == "warning"
            assert finding["evidence"][-1]["metric"] == f"kvgate_sync_down_cause{OOM}"
