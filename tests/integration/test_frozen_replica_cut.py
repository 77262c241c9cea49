"""A frozen replica (its process stopped: connections accepted by the kernel, nothing
answered, not even /health or /metrics) is found down by the first /health probe that times
out while requests have waited there that long with nothing heard from it and none of its
answers under way: its waiting requests are cut and answered by another replica.

Before: a late /health ejected only after `health.slow_threshold` late probes in a row (vLLM
serves /health on the loop that serves requests: a saturated replica answers it late), so
the requests there waited for that many probe timeouts and intervals -- 22-24 s with the
defaults (5 s timeout, 2 s interval, 3 in a row), measured with a stopped simulator under
steady load -- or, the threshold raised, until their client gave up. A replica answering
requests (or with an answer under way) while its /health is late stays in rotation, as
before (tests/integration/test_gray_slow_health.py)."""

from __future__ import annotations

import signal

import openai

from tests.support.frozen import ask_until_two_wait
from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"



def test_a_stopped_replicas_waiting_requests_go_elsewhere_at_the_first_late_probe() -> None:
    # late probes alone never eject here: only silence and a late probe together do
    env = {"KVGATE_HEALTH__INTERVAL_S": "0.5", "KVGATE_HEALTH__TIMEOUT_S": "1",
           "KVGATE_HEALTH__SLOW_THRESHOLD": "1000", "KVGATE_HEALTH__EJECT_BASE_S": "30",
           "KVGATE_HEALTH__STALL_AFTER_S": "0",
           "KVGATE_ROUTING__POLICY": "round_robin", "KVGATE_ROUTING__SILENT_MIN_S": "0"}
    procs: list[Proc] = []
    frozen: Proc | None = None
    try:
        frozen, frozen_url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(frozen.start())
        other, other_url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(other.start())
        gw, base = gateway_proc(upstreams=[frozen_url, other_url], env=env)
        procs.append(gw.start())
        frozen_id = frozen_url.removeprefix("http://")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=20)
        client.chat.completions.create(  # its counters scraped: non-streamed waits count
            model=MODEL, messages=[{"role": "user", "content": "warm"}], max_tokens=2)
        frozen.signal(signal.SIGSTOP)
        sent, outcomes = ask_until_two_wait(client, base, frozen_id, MODEL, "frozen")
        assert outcomes == ["ok"] * sent
        retries = metric_values(base, "kvgate_upstream_retries_total")
        assert sum(v for k, v in retries.items() if 'reason="stall"' in k) >= 2, retries
        healthy = metric_values(base, "kvgate_replica_healthy")
        assert [v for k, v in healthy.items() if frozen_id in k] == [0.0]
        wait_for(lambda: sum(metric_values(base, "kvgate_inflight_requests").values()) == 0,
                 what="nothing in flight")
        assert "nothing heard from it" in gw.output(None)
    finally:
        if frozen is not None:
            frozen.signal(signal.SIGCONT)
        for p in reversed(procs):
            p.stop()
