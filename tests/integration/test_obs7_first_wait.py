"""A replica without engine counters (``--disable-log-stats``) whose engine hangs, seen before
kvgate ejects it: its /metrics says nothing and the blind-stall rule waits for
`health.stall_after_s` (60 s by default). `kvgate_replica_oldest_wait_seconds` shows the age of
the oldest request of kvgate's waiting there for its first event, and `kvgate doctor` names
"requests waiting for a first token on <replica> for N s, nothing returned" while the replica
is still in rotation. Real gateway, two simulators (the hung one without stats), /metrics over
HTTP, the doctor's CLI as a user runs it, the official openai client."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import openai

from tests.support.frozen import held_on
from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import ROOT, Proc, sim_proc

MODEL = "sim-model"
ADMIN = "obs7-first-wait-admin-token-0123456789"  # tests only
HUNG_S = 2.0  # the doctor's hung_s, lowered for a short test (stall_after_s stays 60 s)
ENV = {"KVGATE_HEALTH__STALL_AFTER_S": "60", "KVGATE_ROUTING__POLICY": "round_robin",
       "KVGATE_DOCTOR__INTERVAL_S": "0.1", "KVGATE_DOCTOR__THRESHOLDS__HUNG_S": str(HUNG_S),
       "KVGATE_ADMIN_TOKEN": ADMIN}


def _ask(client: openai.OpenAI, i: int) -> None:
    try:
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"wait {i} " * 20}],
            max_tokens=4, stream=True)
        sum(1 for _ in out)
    except openai.APIError:
        pass  # the hung replica's requests end when the processes stop


def _oldest(base: str, replica: str) -> float:
    values = metric_values(base, "kvgate_replica_oldest_wait_seconds")
    return max((v for k, v in values.items() if replica in k), default=-1.0)


def test_a_hung_stats_less_replica_is_named_before_its_ejection(procs: list[Proc]) -> None:
    blind, blind_url = sim_proc(None, "--time-scale", "20", "--disable-log-stats", model=MODEL)
    procs.append(blind.start())
    other, other_url = sim_proc(None, "--time-scale", "20", model=MODEL)
    procs.append(other.start())
    gw, base = gateway_proc(upstreams=[blind_url, other_url], env=ENV)
    procs.append(gw.start())
    blind_id, other_id = (u.removeprefix("http://") for u in (blind_url, other_url))
    # idle: exported, 0 (an alert can read it before anything waits)
    assert _oldest(base, blind_id) == 0.0 and _oldest(base, other_id) == 0.0
    httpx.post(f"{blind_url}/sim/faults", json={"engine_hang": True}, timeout=5
               ).raise_for_status()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    asked: list[threading.Thread] = []
    try:
        while held_on(base, blind_id) < 2 and len(asked) < 40:
            asked.append(threading.Thread(target=_ask, args=(client, len(asked)), daemon=True))
            asked[-1].start()
            time.sleep(0.05)
        wait_for(lambda: _oldest(base, blind_id) >= HUNG_S + 1.0, timeout=30,
                 what="the oldest wait on the hung replica past hung_s")
        assert _oldest(base, other_id) == 0.0  # the healthy one answered its requests
        done = subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", "--url", base,
                               "--window", "10s", "--json"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60,
                              env={"PATH": "/usr/bin:/bin", "KVGATE_ADMIN_TOKEN": ADMIN})
        assert done.stdout, done.stderr
        findings = json.loads(done.stdout)["findings"]
        first = findings[0]
        assert (first["class"], first["severity"], first["replica"]) == (
            "down", "critical", blind_id), findings
        assert first["summary"].startswith(
            f"requests waiting for a first token on {blind_id} for "), first
        assert "nothing returned" in first["summary"], first
        assert "--disable-log-stats" in first["summary"], first
        assert "restart its vLLM process" in first["action"], first
        # before ejection: still in rotation, never found stalled
        healthy = metric_values(base, "kvgate_replica_healthy")
        assert [v for k, v in healthy.items() if blind_id in k] == [1.0]
        stalls = metric_values(base, "kvgate_replica_stalls_total")
        assert [v for k, v in stalls.items() if blind_id in k] == [0.0]
    finally:
        httpx.post(f"{blind_url}/sim/faults", json={"engine_hang": False}, timeout=5)
    for t in asked:
        t.join(timeout=30)
