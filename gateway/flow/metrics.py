"""Flow control's metric families (docs/metrics.md): counters updated as requests queue, wait,
are shed or served, and gauges read from the queues when `/metrics` is scraped."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.metrics import LATENCY_BUCKETS
from routing.flow import PoolFlow

__all__ = ["FlowMetrics"]

Queues = Callable[[], Iterable[tuple[str, PoolFlow[Any]]]]  # (pool, its flow) per queue
Saturation = Callable[[], Iterable[tuple[str, bool]]]  # (pool, saturated) per live pool


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry, queues: Queues,
                 saturation: Saturation) -> None:
        self.queued = Counter(
            "kvgate_flow_queued_total", "requests that waited in flow control's queue",
            ["pool", "tier"], registry=registry)
        self.wait = Histogram(
            "kvgate_flow_wait_seconds", "time released requests waited in the queue", ["tier"],
            buckets=LATENCY_BUCKETS, registry=registry)
        self.shed = Counter(
            "kvgate_flow_shed_total", "queued or arriving requests shed by flow control",
            ["pool", "tier", "reason"], registry=registry)
        self.abandoned = Counter(
            "kvgate_flow_abandoned_total", "queued requests whose client disconnected",
            ["pool", "tier"], registry=registry)
        self.dequeued = Counter(
            "kvgate_flow_dequeued_total",
            "queued requests that left the queue, by outcome (released, shed, abandoned, moved "
            "to another pool, refused: key revoked or tenant deleted, interrupted: shutdown); "
            "with the depth it adds up to kvgate_flow_queued_total",
            ["pool", "tier", "outcome"], registry=registry)
        self.tokens = Counter(
            "kvgate_flow_served_tokens_total",
            "tokens (prompt + expected output) sent on by flow control, counted when the "
            "request is over (refused before any output: its prompt only): the fair-share view",
            ["pool", "tier", "tenant"], registry=registry)
        registry.register(_FlowCollector(queues, saturation))
        self._children: dict[tuple[object, ...], Any] = {}

    def forget_pool(self, pool: str) -> None:
        """Drop the series of `pool` (its labels come first: every family but `wait`)."""
        by_id: dict[object, Any] = {
            id(m): m for m in (self.queued, self.shed, self.abandoned, self.dequeued, self.tokens)}
        for key in [k for k in self._children if k[0] in by_id and k[1] == pool]:
            del self._children[key]
            by_id[key[0]].remove(*key[1:])

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric``'s child for ``labels``, looked up once."""
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child


class _FlowCollector(Collector):
    """Queue depth per pool and band, whether each pool is saturated, and the requests held
    for spare room (the share cap's hogs, counted by the core), at scrape time."""

    def __init__(self, queues: Queues, saturation: Saturation) -> None:
        self._queues = queues
        self._saturation = saturation

    def collect(self) -> list[Metric]:
        depth = GaugeMetricFamily("kvgate_flow_queue_depth",
                                  "requests waiting in flow control's queue",
                                  labels=["pool", "band"])
        sat = GaugeMetricFamily("kvgate_flow_saturated",
                                "1 when no healthy replica of the pool has room",
                                labels=["pool"])
        holds = CounterMetricFamily("kvgate_flow_hog_holds",
                                    "queued requests passed over at a release because their "
                                    "tenant is a hog and no replica had spare room",
                                    labels=["pool"])
        for name, flow in self._queues():
            for band, n in flow.queue.depth().items():
                depth.add_metric([name, str(band)], n)
            holds.add_metric([name], flow.hog_holds)
        for name, saturated in self._saturation():
            sat.add_metric([name], 1.0 if saturated else 0.0)
        return [depth, sat, holds]
