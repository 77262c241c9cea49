"""The doctor's finding for a replica kvgate found stalled though it exports no engine counters
(vLLM ``--disable-log-stats``: the gateway judged it on its own evidence, its streams waiting for
their first event), on recorded window numbers."""

from __future__ import annotations

from typing import Any

from gateway.doctor.replica_rules import classify_replica
from tests.unit.doctor.test_rules import CTX, TH, replica

# found stalled a moment ago: out now for 10% of the window, its /metrics without vllm:* (so
# every sample is stale, as the scrape rule counts it)
BLIND: dict[str, Any] = dict(healthy_share=0.9, healthy_last=0.0, stalls=1.0,
                             stalled_last=False,
                             no_stats=True, fresh=0, stale_share=1.0, requests=0.0,
                             generation_tokens=0.0)


def test_a_blind_stall_says_whose_evidence_and_comes_before_its_metrics() -> None:
    (f,) = classify_replica(replica(**BLIND), TH, CTX)
    assert (f.cls, f.severity) == ("down", "critical")
    assert f.summary.startswith("replica stalled:")
    assert "no engine counters" in f.summary and "first event" in f.summary
    assert "token counters frozen" not in f.summary
    assert "--disable-log-stats" in f.action and "counters move" not in f.action


def test_a_stall_with_counters_just_now_is_named_at_once() -> None:
    (f,) = classify_replica(replica(**{**BLIND, "no_stats": False, "fresh": 30,
                                       "stale_share": 0.0}), TH, CTX)
    assert (f.cls, f.severity) == ("down", "critical")
    assert "token counters frozen" in f.summary and "counters move" in f.action


def test_a_stall_long_gone_is_not_down_now() -> None:
    # back in rotation for most of the window: not out now, no finding of a past blip
    back = replica(**{**BLIND, "healthy_last": 1.0, "no_stats": False, "fresh": 30,
                      "stale_share": 0.0, "requests": 30.0})
    assert all(f.cls != "down" for f in classify_replica(back, TH, CTX))
