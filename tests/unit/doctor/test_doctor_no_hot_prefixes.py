"""An in-flight imbalance in traffic that shares no prefixes is not blamed on hot prefixes.

Seen live: one replica of three 100 ms further away (the simulator's ``latency_ms``) under
unique short prompts, and the fast replica a cache-aware router sent its first requests to,
were each named with "lower routing.load_factor so the bounded-load rule spreads hot prefixes
sooner" -- while the sampled prefix sharing the traffic allows was 0 %. The numbers here are
the first of those reports' (mean in flight 5.65 against 3.3 and 2.3, 3.98 running in the
engine, every engine as fast).
"""

from __future__ import annotations

from typing import Any

from gateway.doctor.findings import Context
from gateway.doctor.pool_rules import classify_pool
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import PoolStats, ReplicaStats

TH = Thresholds()


def _replica(rid: str, **kw: Any) -> ReplicaStats:
    base = {"samples": 40, "fresh": 40, "healthy_share": 1.0, "healthy_last": 1.0,
            "span_s": 10.0, "ttft_mean": 0.0095, "itl_mean": 0.0065, "waiting_share": 0.02,
            "waiting_mean": 0.0, "kv_p90": 0.001}
    return ReplicaStats(rid, "p", **(base | kw))


def _pool(potential: float | None) -> PoolStats:
    p = PoolStats("p", samples=40, requests=555.0)
    if potential is not None:  # the sampled routing decisions (`sharing.py`)
        p.share_n, p.share_prompt = 200.0, 3600.0
        p.share_best = p.share_chosen = potential * 3600.0
    p.replicas = [
        _replica("far", inflight_mean=5.65, running_mean=3.975, requests=222.0),
        _replica("a", inflight_mean=3.275, running_mean=2.675, requests=170.0),
        _replica("b", inflight_mean=2.325, running_mean=3.325, requests=163.0)]
    return p


def test_no_shared_prefixes_no_hot_prefix_action() -> None:
    (f,) = classify_pool(_pool(0.0), TH, Context())
    assert (f.cls, f.replica) == ("routing", "far")
    assert "hot prefixes" not in f.action and "load_factor" not in f.action
    assert "shares no prefixes" in f.action and "host, network and HTTP frontend" in f.action
    assert "time per request 255 ms vs 168 ms on its peers" in f.action
    assert any(e.what == "prefix sharing the traffic allows" and e.value == 0.0
               for e in f.evidence)


def test_traffic_with_shared_prefixes_or_no_sample_keeps_the_bounded_load_action() -> None:
    for potential in (0.6, None):
        (f,) = classify_pool(_pool(potential), TH, Context())
        assert f.replica == "far" and f.action.startswith("lower routing.load_factor"), potential
