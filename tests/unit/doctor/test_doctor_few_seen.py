"""A spread of in-flight counts or of time per request needs requests seen in flight at enough
ticks: on a host at load average 17, a healthy pair of replicas 1.9 s into a light load (7
ticks) was named "imbalance: time per request ... 149 ms vs a median of 39 ms" from ~10
requests seen in flight, and a tenant's burst of rate-limited requests at its load's start
"imbalance: mean in flight ... 2.4 vs a median of 0.2" from 5 ticks."""

from __future__ import annotations

from gateway.doctor.pool_rules import classify_pool
from tests.unit.doctor.test_rules import CTX, TH, classes, pool, replica

SHORT = {"samples": 7, "fresh": 7, "span_s": 1.75}


def test_a_time_per_request_spread_seen_in_few_ticks_is_not_judged() -> None:
    # 1.5 in flight over 7 ticks (~10 seen), 20 requests each: 131 ms per request vs 26 ms
    hot = replica("hot", inflight_mean=1.5, requests=20.0, running_mean=1.2, **SHORT)
    peer = replica("peer", inflight_mean=0.3, requests=20.0, running_mean=0.3, **SHORT)
    assert classes(classify_pool(pool(hot, peer, requests=60.0, samples=7), TH, CTX)) == [
        "healthy"]
    # the same spread over 40 ticks is seen in 60 request-ticks: named
    long = replica("hot", inflight_mean=1.5, requests=100.0, running_mean=1.2)
    fast = replica("peer", inflight_mean=0.3, requests=100.0, running_mean=0.3)
    (f,) = classify_pool(pool(long, fast, requests=200.0), TH, CTX)
    assert (f.cls, f.replica) == ("routing", "hot") and "time per request" in f.summary


def test_an_in_flight_spread_of_a_burst_in_few_ticks_is_not_judged() -> None:
    hot = replica("hot", inflight_mean=2.4, requests=29.0, running_mean=2.0, **SHORT)
    peer = replica("peer", inflight_mean=0.2, requests=30.0, running_mean=0.2, **SHORT)
    hot.samples = peer.samples = 5
    assert classes(classify_pool(pool(hot, peer, requests=59.0, samples=5), TH, CTX)) == [
        "healthy"]
