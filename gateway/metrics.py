"""The gateway's own Prometheus metrics (names from docs/metrics.md), one registry per app.

Hot-path cost matters: labelled children are cached per label tuple, and the per-replica
gauges (in flight, healthy) are read from replica state at scrape time by a collector rather
than updated on every request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.replicas import Replica

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
# LLM latencies span milliseconds (TTFT on a warm cache) to many minutes (long generations)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
OVERHEAD_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 0.0016, 0.0032, 0.0064, 0.0128)


class _ReplicaCollector(Collector):
    def __init__(self, replicas: Callable[[], Iterable[Replica]], clock: Callable[[], float]):
        self._replicas = replicas
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily(
            "kvgate_inflight_requests", "requests in flight per replica", labels=["pool", "replica"]
        )
        healthy = GaugeMetricFamily(
            "kvgate_replica_healthy", "1 healthy, 0 ejected", labels=["pool", "replica"]
        )
        now = self._clock()
        for r in self._replicas():
            inflight.add_metric([r.pool, r.id], r.inflight)
            healthy.add_metric([r.pool, r.id], 1.0 if r.available(now) else 0.0)
        yield inflight
        yield healthy


class _TenancyCollector(Collector):
    """`kvgate_redis_up` (only with Redis) and `kvgate_policy_version`, read at scrape time."""

    def __init__(self, state: Callable[[], tuple[bool | None, int]]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        redis_up, version = self._state()
        if redis_up is not None:
            up = GaugeMetricFamily(
                "kvgate_redis_up", "1 when the shared store answers, 0 when degraded"
            )
            up.add_metric([], 1.0 if redis_up else 0.0)
            yield up
        policy = GaugeMetricFamily(
            "kvgate_policy_version", "version of the policy document in force"
        )
        policy.add_metric([], float(version))
        yield policy


class GatewayMetrics:
    def __init__(
        self, replicas: Callable[[], Iterable[Replica]], clock: Callable[[], float]
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        reg = self.registry
        self.requests = Counter(
            "kvgate_requests_total", "finished proxied requests",
            ["pool", "replica", "tier", "tenant", "status", "route"], registry=reg,
        )
        self.duration = Histogram(
            "kvgate_request_duration_seconds", "end-to-end latency as the client sees it",
            ["pool", "tier"], buckets=LATENCY_BUCKETS, registry=reg,
        )
        self.ttft = Histogram(
            "kvgate_ttft_seconds", "time to first streamed byte of content",
            ["pool", "tier"], buckets=LATENCY_BUCKETS, registry=reg,
        )
        self.overhead = Histogram(
            "kvgate_overhead_seconds", "time spent inside kvgate", ["phase"],
            buckets=OVERHEAD_BUCKETS, registry=reg,
        )
        self.tokens = Counter(
            "kvgate_tokens_total", "tokens from upstream usage", ["pool", "tier", "kind"],
            registry=reg,
        )
        self.retries = Counter(
            "kvgate_upstream_retries_total", "attempts retried on another replica",
            ["pool", "reason"], registry=reg,
        )
        self.failovers = Counter(
            "kvgate_failovers_total", "requests that succeeded on a fallback replica", ["pool"],
            registry=reg,
        )
        self.rejections = Counter(
            "kvgate_ratelimit_rejections_total", "429s sent by the rate limiter",
            ["tier", "tenant", "limit"], registry=reg,
        )
        self.spillovers = Counter(
            "kvgate_spillovers_total", "requests sent to a tier's spill pool",
            ["tier", "from_pool", "to_pool"], registry=reg,
        )
        reg.register(_ReplicaCollector(replicas, clock))
        self._children: dict[tuple[Any, ...], Any] = {}
        self.pre_upstream = self.overhead.labels("pre_upstream")

    def _child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def finished(
        self, pool: str, replica: str, status: int, route: str, duration_s: float,
        tier: str = "default", tenant: str = "default",
    ) -> None:
        self._child(self.requests, (pool, replica, tier, tenant, str(status), route)).inc()
        self._child(self.duration, (pool, tier)).observe(duration_s)

    def first_token(self, pool: str, ttft_s: float, tier: str = "default") -> None:
        self._child(self.ttft, (pool, tier)).observe(ttft_s)

    def usage(self, pool: str, usage: dict[str, int], tier: str = "default") -> None:
        for key, kind in (("prompt_tokens", "prompt"), ("completion_tokens", "completion"),
                          ("cached_tokens", "cached")):
            n = usage.get(key)
            if n:
                self._child(self.tokens, (pool, tier, kind)).inc(n)

    def retried(self, pool: str, reason: str) -> None:
        self._child(self.retries, (pool, reason)).inc()

    def failover(self, pool: str) -> None:
        self._child(self.failovers, (pool,)).inc()

    def rejected(self, tier: str, tenant: str, limit: str) -> None:
        self._child(self.rejections, (tier, tenant, limit)).inc()

    def spilled(self, tier: str, from_pool: str, to_pool: str) -> None:
        self._child(self.spillovers, (tier, from_pool, to_pool)).inc()

    def watch_tenancy(self, state: Callable[[], tuple[bool | None, int]]) -> None:
        """Export the tenancy state: `state()` -> (Redis up or None without Redis, version)."""
        self.registry.register(_TenancyCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)
