"""Prometheus families of the shared routing state, read from `RouteSync` at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gateway.fleet.stats import LAG_BUCKETS
from gateway.fleet.sync import RouteSync
from gateway.metrics import down_cause
from routing.router import Router

__all__ = ["SyncCollector"]


class SyncCollector(Collector):
    """``kvgate_sync_*`` (only when sharing is on) and the routing decision counters."""

    def __init__(
        self, router: Router, sync: RouteSync | None, clock: Callable[[], float]
    ) -> None:
        self._router = router
        self._sync = sync
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        router = self._router
        decisions = CounterMetricFamily(
            "kvgate_routing_decisions", "routing decisions made (explain calls excluded)")
        decisions.add_metric([], float(router.decisions))
        yield decisions
        sync = self._sync
        if sync is None:
            return
        peer = CounterMetricFamily(
            "kvgate_routing_peer_decisions",
            "routing decisions that used other gateways' records (their in-flight load on a "
            "candidate, or the chosen replica's copy of the prefix learned from a peer)")
        peer.add_metric([], float(router.peer_decisions))
        yield peer
        st = sync.stats
        up = GaugeMetricFamily(
            "kvgate_sync_up", "1 while the shared routing state's Redis answers, 0 degraded")
        up.add_metric([], 1.0 if st.up else 0.0)
        yield up
        yield down_cause("kvgate_sync_down_cause", "the shared routing state's Redis",
                         sync.down_cause)
        published = CounterMetricFamily(
            "kvgate_sync_records_published", "batches of routing records written to Redis")
        published.add_metric([], float(st.published))
        yield published
        applied = CounterMetricFamily(
            "kvgate_sync_records_applied", "other gateways' batches applied to this router")
        applied.add_metric([], float(st.applied))
        yield applied
        dropped = CounterMetricFamily(
            "kvgate_sync_records_dropped",
            "records not applied or not published, by reason (malformed, version, foreign, "
            "unpublished)", labels=["reason"])
        for reason in ("malformed", "version", "foreign", "unpublished"):
            dropped.add_metric([reason], float(st.dropped.get(reason, 0)))
        yield dropped
        peers = GaugeMetricFamily(
            "kvgate_sync_peers", "other gateway processes heard from within the staleness bound")
        peers.add_metric([], float(router.peers.members(self._clock()) if router.peers else 0))
        yield peers
        lag = HistogramMetricFamily(
            "kvgate_sync_apply_lag_seconds",
            "a batch's write to Redis to its application here, per batch, on Redis's clock "
            "(the entry's id; no host clock needs to agree with another)")
        cumulative, buckets = 0, []
        for bound, n in zip(LAG_BUCKETS, st.lag_buckets, strict=True):
            cumulative += n
            buckets.append((repr(float(bound)), float(cumulative)))
        buckets.append(("+Inf", float(st.lag_count)))
        lag.add_metric([], buckets, sum_value=st.lag_sum)
        yield lag
