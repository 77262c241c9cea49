"""`kvgate doctor` on a replica without engine counters (``--disable-log-stats``) whose engine
hangs: kvgate finds it stalled on its own evidence (streams waiting there for their first event,
nothing streamed or answered for `health.stall_after_s`), since no `vllm:*` counter can show it.
The doctor's finding must say so, not that "its engine's token counters" froze: the replica has
none, and an operator reading that looks for counters it never exported. Real gateway, two
simulators (the hung one without stats), the doctor's CLI as a user runs it."""

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
ADMIN = "doctor6-blind-admin-token-0123456789"  # tests only
ENV = {"KVGATE_HEALTH__STALL_AFTER_S": "2", "KVGATE_HEALTH__EJECT_BASE_S": "30",
       # (the tests' fast health caps every back-off at 1 s: the stall, over once its streams
       # are cut, let it back before the doctor ran on a loaded machine)
       "KVGATE_HEALTH__EJECT_MAX_S": "60",
       "KVGATE_ROUTING__POLICY": "round_robin", "KVGATE_ROUTING__SILENT_MIN_S": "0",
       "KVGATE_DOCTOR__INTERVAL_S": "0.1", "KVGATE_ADMIN_TOKEN": ADMIN}


def _ask(client: openai.OpenAI, i: int) -> None:
    try:
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"blind {i} " * 50}],
            max_tokens=4, stream=True)
        sum(1 for _ in out)
    except openai.APIError:
        pass


def test_a_blind_stall_is_named_on_kvgates_own_evidence(procs: list[Proc]) -> None:
    blind, blind_url = sim_proc(None, "--time-scale", "20", "--disable-log-stats", model=MODEL)
    procs.append(blind.start())
    other, other_url = sim_proc(None, "--time-scale", "20", model=MODEL)
    procs.append(other.start())
    gw, base = gateway_proc(upstreams=[blind_url, other_url], env=ENV)
    procs.append(gw.start())
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    httpx.post(f"{blind_url}/sim/faults", json={"engine_hang": True}, timeout=5
               ).raise_for_status()
    blind_id = blind_url.removeprefix("http://")
    asked: list[threading.Thread] = []
    while held_on(base, blind_id) < 2 and len(asked) < 40:
        asked.append(threading.Thread(target=_ask, args=(client, len(asked))))
        asked[-1].start()
        time.sleep(0.05)
    wait_for(lambda: sum(v for k, v in metric_values(base, "kvgate_replica_stalls_total")
                         .items() if blind_id in k) >= 1, timeout=30, what="found stalled")
    for t in asked:
        t.join(timeout=45)
    done = subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", "--url", base,
                           "--window", "5s", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "KVGATE_ADMIN_TOKEN": ADMIN})
    assert done.returncode == 0, done.stdout + done.stderr
    findings = json.loads(done.stdout)["findings"]
    first = findings[0]
    assert (first["class"], first["replica"]) == ("down", blind_id), findings
    assert "stalled" in first["summary"], first
    assert "token counters" not in first["summary"], first
    assert "no engine counters" in first["summary"], first
    assert "--disable-log-stats" in first["action"], first
    # its missing /metrics series are the same replica's known state, not a second alarm
    assert not [f for f in findings if f["class"] == "gateway" and f["replica"] == blind_id]
