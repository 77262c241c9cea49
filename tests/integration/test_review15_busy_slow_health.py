"""A healthy replica busy with long non-streamed requests whose `/health` is late (vLLM
serves it on the event loop that serves its requests) but whose `/metrics` is read as usual
is alive: it stays in rotation and its requests are not cut and run again elsewhere.

Before, the slow-probe rule counted only finished answers as life: long non-streamed
requests finish none within a probe, so `health.slow_threshold` late probes ejected it, and
since an ejection by the health checks cuts the requests that got nothing yet, each one was
abandoned and run again on another replica (`x-kvgate-route: retry`, reason stall): the
fleet's work doubled on a burst. Real gateway, two simulated replicas, the official client.
"""

from __future__ import annotations

import threading

import httpx
import openai

from tests.support.gateway import gateway_proc, metric_values
from tests.support.procs import Proc, start_sims

MODEL = "sim-model"
ENV = {"KVGATE_HEALTH__INTERVAL_S": "0.3", "KVGATE_HEALTH__TIMEOUT_S": "1",
       "KVGATE_HEALTH__SLOW_THRESHOLD": "2", "KVGATE_ROUTING__POLICY": "round_robin"}


def test_a_busy_replica_with_a_late_health_keeps_its_requests() -> None:
    procs: list[Proc] = []
    try:
        # each request waits 6 s before it starts; /health answers 2.5 s late
        _, urls = start_sims(procs, 2, "--time-scale", "50")
        gw, base = gateway_proc(upstreams=urls, env=ENV)
        procs.append(gw.start())
        for url in urls:
            httpx.post(f"{url}/sim/faults", json={"latency_ms": 6000, "health_latency_ms": 2500},
                       timeout=10).raise_for_status()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        answers: list[str] = []

        def ask(i: int) -> None:
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"busy {i}"}],
                    max_tokens=4)
                raw.parse()
                answers.append(raw.headers["x-kvgate-route"])
            except openai.APIError as exc:
                answers.append(repr(exc))

        asked = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in asked:
            t.start()
        for t in asked:
            t.join(timeout=90)
        assert len(answers) == 4 and "retry" not in answers, answers
        assert not any("Error" in a for a in answers), answers
        retries = metric_values(base, "kvgate_upstream_retries_total")
        assert sum(retries.values()) == 0, retries
        healthy = metric_values(base, "kvgate_replica_healthy")
        assert sorted(healthy.values()) == [1.0, 1.0], healthy
    finally:
        for p in reversed(procs):
            p.stop()


def test_a_replica_without_stats_waiting_on_a_late_health_is_not_frozen() -> None:
    """`--disable-log-stats`: its /metrics page has no vllm:* series but it is an answer.
    Before, such a page did not count as a sign of life: one late /health probe while a
    non-streamed request waited there read the replica as frozen (a stopped process), its
    requests cut and run again elsewhere, here a 504 for want of another replica."""
    procs: list[Proc] = []
    try:
        _, urls = start_sims(procs, 1, "--time-scale", "50", "--disable-log-stats")
        env = {**ENV, "KVGATE_HEALTH__SLOW_THRESHOLD": "1000"}  # the frozen rule alone
        gw, base = gateway_proc(upstreams=urls, env=env)
        procs.append(gw.start())
        httpx.post(f"{urls[0]}/sim/faults", json={"latency_ms": 9000, "health_latency_ms": 2500},
                   timeout=10).raise_for_status()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "no stats"}], max_tokens=4)
        assert raw.parse().choices[0].message.content
        assert raw.headers["x-kvgate-route"] != "retry"
        assert sum(metric_values(base, "kvgate_upstream_retries_total").values()) == 0
        assert list(metric_values(base, "kvgate_replica_healthy").values()) == [1.0]
    finally:
        for p in reversed(procs):
            p.stop()


def test_a_replica_whose_metrics_page_is_late_too_is_not_frozen() -> None:
    """Its /metrics page comes 2.5 s late, within the scrape timeout (5 s), so no page may
    land within one 1 s /health probe. Before, such a probe read the replica, busy but
    alive, as frozen: its waiting non-streamed request was cut (here a 504, no other
    replica). Now the silence must also span a scrape's bound before it is a freeze."""
    procs: list[Proc] = []
    try:
        _, urls = start_sims(procs, 1, "--time-scale", "50")
        env = {**ENV, "KVGATE_HEALTH__SLOW_THRESHOLD": "1000"}  # the frozen rule alone
        gw, base = gateway_proc(upstreams=urls, env=env)
        procs.append(gw.start())
        httpx.post(f"{urls[0]}/sim/faults", timeout=10, json={
            "latency_ms": 9000, "health_latency_ms": 2500, "metrics_latency_ms": 2500,
        }).raise_for_status()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "late page"}], max_tokens=4)
        assert raw.parse().choices[0].message.content
        assert raw.headers["x-kvgate-route"] != "retry"
        assert sum(metric_values(base, "kvgate_upstream_retries_total").values()) == 0
    finally:
        for p in reversed(procs):
            p.stop()
