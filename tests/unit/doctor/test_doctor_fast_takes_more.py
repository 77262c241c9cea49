"""A fast replica the router prefers holds the most in flight without anything waiting longer
on it: beside a 5x slower replica (an A100-70B-AWQ beside an H100-8B, cache-aware routing) on
a CPU-starved host, the fast one held ~4 requests in flight, ~1 of them in its engine (the
rest in the starved relay), and was named "imbalance: mean in flight ... requests sit before
its engine" -- though it answered each request in a third of the slow one's time. The slow
one, sent too few requests for its own time per request to be judged, went unnamed by that
rule. test_doctor.py's slow-replica case failed on it under heavy host load."""

from __future__ import annotations

from gateway.doctor.pool_rules import classify_pool
from tests.unit.doctor.test_rules import CTX, TH, pool, replica


def test_the_fast_replica_taking_more_is_not_named_for_its_in_flight() -> None:
    fast = replica("fast", inflight_mean=4.2, running_mean=1.0, waiting_mean=0.3,
                   waiting_share=0.26, requests=190.0, itl_mean=0.007, ttft_mean=0.056)
    slow = replica("slow", inflight_mean=1.2, running_mean=1.0, waiting_mean=0.0,
                   waiting_share=0.0, requests=16.0, itl_mean=0.033, ttft_mean=0.09)
    found = classify_pool(pool(fast, slow, requests=206.0), TH, CTX)
    assert all(f.replica != "fast" for f in found), [f.summary for f in found]
    assert [(f.cls, f.replica) for f in found] == [("routing", "slow")]


def test_a_hot_replica_slower_per_request_than_its_peers_is_still_named() -> None:
    # the same in flight, its engine holding them and each request taking longer there
    hot = replica("hot", inflight_mean=4.2, running_mean=1.0, waiting_mean=0.3,
                  waiting_share=0.26, requests=60.0, itl_mean=0.007, ttft_mean=0.056)
    peer = replica("peer", inflight_mean=1.2, requests=100.0, itl_mean=0.007)
    (f,) = classify_pool(pool(hot, peer, requests=160.0), TH, CTX)
    assert (f.cls, f.replica) == ("routing", "hot") and f.summary.startswith("imbalance")
