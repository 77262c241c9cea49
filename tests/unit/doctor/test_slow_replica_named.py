"""Under a load-aware policy a slow replica gets little and its peers hold more in flight: the
doctor names the slow one (its time per request), not the peer that absorbed its traffic
(gray failures, scenario 1: `loadtest.gray_failures`)."""

from __future__ import annotations

from gateway.doctor.pool_rules import classify_pool
from tests.unit.doctor.test_rules import CTX, TH, pool, replica


def test_the_slow_replica_is_named_not_the_one_that_took_its_traffic() -> None:
    absorber = replica("hot", inflight_mean=4.0, requests=300.0)
    slow = replica("slow", inflight_mean=1.5, requests=30.0, running_mean=1.0)
    others = [replica(r, inflight_mean=1.6, requests=150.0) for r in ("a", "b")]
    (f,) = classify_pool(pool(absorber, slow, *others, requests=630.0), TH, CTX)
    assert (f.cls, f.replica) == ("routing", "slow")
    assert "time per request on slow" in f.summary and "check its GPU" in f.action


def test_in_flight_still_names_a_hot_replica_that_is_also_the_slowest() -> None:
    hot = replica("hot", inflight_mean=12.0, running_mean=10.0, waiting_mean=2.0)
    (f,) = classify_pool(pool(hot, replica("a"), replica("b")), TH, CTX)
    assert (f.replica, f.summary.startswith("imbalance: mean in flight on hot")) == ("hot", True)
