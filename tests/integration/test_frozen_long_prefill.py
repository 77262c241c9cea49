"""A replica whose only requests wait for a long prompt's prefill (a 17k-token prompt on a
70B model: ~9 s before its first token, its engine's counters still until it comes) and whose
/health answers late (vLLM serves it on the loop that serves requests) is busy, not frozen:
its request is answered there, and it stays in rotation.

Before: the first late probe after the probe timeout took it for a frozen replica
(`gateway.health._frozen`: requests waiting that long with nothing heard from it): marked
down, its request cut and tried on the other replica, where the same happened: the client got
a 504 'stopped making progress' after ~8 s, both replicas down, for one long prompt. Its
learned TTFT model (the one `Replica.hung` judges a first-byte cut by) says that prefill
takes about that long; a late probe takes it for frozen past twice that."""

from __future__ import annotations

import httpx
import openai

from tests.support.gateway import gateway_proc, metric_values
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"


def test_a_long_prefill_behind_a_late_health_probe_is_not_taken_for_a_frozen_replica() -> None:
    env = {"KVGATE_HEALTH__INTERVAL_S": "0.5", "KVGATE_HEALTH__TIMEOUT_S": "2",
           "KVGATE_HEALTH__SLOW_THRESHOLD": "1000", "KVGATE_ROUTING__POLICY": "round_robin"}
    procs: list[Proc] = []
    try:
        urls = []
        for _ in range(2):  # 0.5 ms a prompt token: a 70B model on one A100
            sim, url = sim_proc(None, "--preset", "a100-70b-awq", model=MODEL)
            procs.append(sim.start())
            urls.append(url)
        gw, base = gateway_proc(upstreams=urls, env=env)
        procs.append(gw.start())
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        for i in range(4):  # both replicas learn how long their prefills take
            client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
                {"role": "user", "content": f"learn {i} " * 2500}])
        for url in urls:  # /health late from now on, as on a saturated replica's loop
            httpx.post(f"{url}/sim/faults", json={"health_latency_ms": 3000}).raise_for_status()
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "long " * 11000}],
            max_tokens=4, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        retries = metric_values(base, "kvgate_upstream_retries_total")
        assert sum(retries.values()) == 0, retries
        healthy = metric_values(base, "kvgate_replica_healthy")
        assert sorted(healthy.values()) == [1.0, 1.0], healthy
        assert "frozen" not in gw.output(None)
    finally:
        for p in reversed(procs):
            p.stop()
