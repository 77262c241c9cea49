"""The gateway's own Prometheus metrics (names from docs/metrics.md), one registry per app.

Hot-path cost matters: labelled children are cached per label tuple, and every per-replica
gauge (in flight, health, scraped engine state, scrape age and errors, affinity-index size) is
read from replica state at scrape time by a collector rather than updated on every request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from gateway import __version__
from gateway.replica_state import STORED_REASONS
from gateway.replicas import Replica
from gateway.tenancy.redis_conn import CAUSE_LABELS

__all__ = ["CONTENT_TYPE", "GatewayMetrics", "TenantTokens", "down_cause"]

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
# LLM latencies span milliseconds (TTFT on a warm cache) to many minutes (long generations)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# gaps between streamed chunks: a few ms (fast decode, batched tokens) to seconds (preemption)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
               1, 2.5)
OVERHEAD_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 0.0016, 0.0032, 0.0064, 0.0128)


# per-replica gauges: (name, help, value of a replica or None when unknown)
_REPLICA_GAUGES: tuple[tuple[str, str, Callable[[Replica], float | None]], ...] = (
    ("kvgate_replica_waiting", "scraped vllm:num_requests_waiting",
     lambda r: r.scraped.waiting if r.scraped else None),
    ("kvgate_replica_running", "scraped vllm:num_requests_running",
     lambda r: r.scraped.running if r.scraped else None),
    ("kvgate_replica_kv_usage", "scraped KV-cache usage (0..1, fullest engine)",
     lambda r: r.scraped.kv_usage if r.scraped else None),
    ("kvgate_replica_prefix_cache_hit_ratio",
     "prefix-cache hit tokens / queried tokens between the last two scrapes",
     lambda r: r.hit_ratio),
)


class _ReplicaCollector(Collector):
    """Everything that describes a replica, read from replica state when /metrics is served
    (nothing per request): in flight, health, the scraped engine state, scrape age and
    errors, the router's affinity-index size."""

    def __init__(
        self, replicas: Callable[[], Iterable[Replica]], clock: Callable[[], float],
        scrape_errors: Callable[[str], int], affinity: Callable[[], dict[str, int]],
        pools: Callable[[], Iterable[str]],
    ) -> None:
        self._replicas = replicas
        self._pools = pools
        self._clock = clock
        self._scrape_errors = scrape_errors
        self._affinity = affinity

    def collect(self) -> Iterator[Metric]:
        labels = ["pool", "replica"]
        inflight = GaugeMetricFamily(
            "kvgate_inflight_requests", "requests in flight per replica", labels=labels)
        healthy = GaugeMetricFamily(
            "kvgate_replica_healthy", "1 healthy, 0 ejected or draining", labels=labels)
        gauges = [GaugeMetricFamily(n, h, labels=labels) for n, h, _ in _REPLICA_GAUGES]
        age = GaugeMetricFamily(
            "kvgate_replica_scrape_age_seconds", "age of the last good scrape", labels=labels)
        errors = CounterMetricFamily(
            "kvgate_scrape_errors", "failed scrapes of a replica's /metrics", labels=labels)
        attempts = CounterMetricFamily(
            "kvgate_replica_attempts", "requests sent to a replica, retries included",
            labels=labels)
        failed = CounterMetricFamily(
            "kvgate_replica_failures", "requests that failed on a replica (5xx, reset, stall, "
            "cut stream, dead engine), retried elsewhere where they could be; a pool's only "
            "replica's 500s for single requests too, which never eject it", labels=labels)
        stalls = CounterMetricFamily(
            "kvgate_replica_stalls", "times a replica was found stalled: requests running, "
            "its engine's token counters frozen for health.stall_after_s (ejected)",
            labels=labels)
        stalled = GaugeMetricFamily(
            "kvgate_replica_stalled", "1 while its engine is judged stalled (kept out)",
            labels=labels)
        stored = CounterMetricFamily(
            "kvgate_stored_response_unavailable", "Responses API requests for a response "
            "stored on the replica answered 503 because it could not serve it (reason: down, "
            "stalled, asleep)", labels=[*labels, "reason"])
        oldest = GaugeMetricFamily(
            "kvgate_replica_oldest_wait_seconds", "age of the oldest request of kvgate's "
            "still waiting there for its first event (a non-streamed one: its whole answer), "
            "0 with none", labels=labels)
        affinity = GaugeMetricFamily(
            "kvgate_affinity_index_entries", "prefix blocks remembered per replica",
            labels=labels)
        # per pool in force, so a pool with no replica listed or discovered (every pod gone)
        # still has a series, 0: the per-replica gauges have none for it to alert on
        pool_healthy = dict.fromkeys(self._pools(), 0)
        entries = self._affinity()
        now = self._clock()
        mono = time.monotonic()  # the leases' clock
        for r, others in _once(self._replicas()):
            key = [r.pool, r.id]
            inflight.add_metric(key, r.inflight + sum(o.inflight for o in others))
            oldest.add_metric(key, max(o.oldest_wait_s(mono) for o in (r, *others)))
            for reason in STORED_REASONS:
                n = sum(o.stored_503s.get(reason, 0) for o in (r, *others))
                if n:
                    stored.add_metric([*key, reason], n)
            up = not r.draining and r.available(now)
            healthy.add_metric(key, 1.0 if up else 0.0)
            if up and r.pool in pool_healthy:
                pool_healthy[r.pool] += 1
            for family, (_, _, read) in zip(gauges, _REPLICA_GAUGES, strict=True):
                value = read(r)
                if value is not None:
                    family.add_metric(key, value)
            if r.scraped is not None:
                age.add_metric(key, now - r.scraped_at)
            errors.add_metric(key, self._scrape_errors(r.id))
            attempts.add_metric(key, r.attempts)
            failed.add_metric(key, r.failed)
            stalls.add_metric(key, r.stalls)
            stalled.add_metric(key, 1.0 if r.stalled else 0.0)
            affinity.add_metric(key, entries.get(r.id, 0))
        per_pool = GaugeMetricFamily(
            "kvgate_pool_healthy_replicas", "replicas of the pool taking requests (0 with none "
            "listed or discovered)", labels=["pool"])
        for pool, n in pool_healthy.items():
            per_pool.add_metric([pool], n)
        yield from (inflight, healthy, *gauges, age, errors, attempts, failed, stalls, stalled,
                    oldest, stored, affinity, per_pool)


def _once(replicas: Iterable[Replica]) -> Iterator[tuple[Replica, list[Replica]]]:
    """Each (pool, replica id) once, with its other entries (their requests in flight and
    waiting count for it): a
    replica listed again under another URL of the same host:port (``http://`` made
    ``https://``, a path prefix added) while its old entry drains is two `Replica`s, one
    series. The first listed (the one in the pool now: `Pools.described`) describes it."""
    first: dict[tuple[str, str], Replica] = {}
    more: dict[tuple[str, str], list[Replica]] = {}
    for r in replicas:
        key = (r.pool, r.id)
        if key in first:
            more.setdefault(key, []).append(r)
        else:
            first[key] = r
    for key, r in first.items():
        yield r, more.get(key, [])


def down_cause(name: str, what: str, cause: str | None) -> GaugeMetricFamily:
    """An enum gauge over `CAUSE_LABELS`: 1 for the cause of the current outage, 0 for the
    others (all 0 while Redis answers), so an alert can name it without a free-text label."""
    family = GaugeMetricFamily(
        name, f"1 for why {what} fails now (refused: oom, wrongtype, noperm, auth, loading, "
        "readonly, misconf, dbindex, protected, other; or unreachable, timeout, notredis), 0 "
        "for the other causes",
        labels=["cause"])
    for label in CAUSE_LABELS:
        family.add_metric([label], 1.0 if label == cause else 0.0)
    return family


class _TenancyCollector(Collector):
    """`kvgate_redis_up` and `kvgate_redis_down_cause` (only with Redis),
    `kvgate_policy_version` and `kvgate_build_info`, read at scrape time."""

    def __init__(self, state: Callable[[], tuple[bool | None, int]],
                 cause: Callable[[], str | None]) -> None:
        self._state = state
        self._cause = cause

    def collect(self) -> Iterator[Metric]:
        redis_up, version = self._state()
        if redis_up is not None:
            up = GaugeMetricFamily(
                "kvgate_redis_up", "1 when the shared store answers, 0 when degraded"
            )
            up.add_metric([], 1.0 if redis_up else 0.0)
            yield up
            yield down_cause("kvgate_redis_down_cause", "the tenancy store's Redis",
                             None if redis_up else self._cause())
        policy = GaugeMetricFamily(
            "kvgate_policy_version", "version of the policy document in force"
        )
        policy.add_metric([], float(version))
        yield policy
        # which release runs here: version skew across gateways during a rolling upgrade
        build = GaugeMetricFamily("kvgate_build_info", "1, labelled with kvgate's version",
                                  labels=["version"])
        build.add_metric([__version__], 1.0)
        yield build


class TenantTokens:
    """Prompt and cached tokens from upstream usage per (tenant label, pool): a plain dict of
    small lists, updated once per answered request (no lock, no label lookup), exported as
    ``kvgate_tenant_tokens_total`` when /metrics is served and read by `kvgate doctor`.
    Tenant labels are the bounded ones (allow-list or first N, then ``_other``)."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        # (tenant, pool) -> [requests with usage, prompt tokens, cached tokens,
        #                    requests whose usage reported cached_tokens]
        self.counts: dict[tuple[str, str], list[int]] = {}

    def add(self, tenant: str, pool: str, usage: dict[str, int]) -> None:
        c = self.counts.get((tenant, pool))
        if c is None:
            c = self.counts[(tenant, pool)] = [0, 0, 0, 0]
        c[0] += 1
        c[1] += usage.get("prompt_tokens", 0)
        cached = usage.get("cached_tokens")
        if cached is not None:
            c[2] += cached
            c[3] += 1

    def forget_pool(self, pool: str) -> None:
        for key in [k for k in self.counts if k[1] == pool]:
            del self.counts[key]


class _TenantTokensCollector(Collector):
    def __init__(self, tokens: TenantTokens) -> None:
        self._tokens = tokens

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "kvgate_tenant_tokens", "prompt and cached (prefix-cache hit) tokens from upstream "
            "usage per tenant and pool", labels=["tenant", "pool", "kind"])
        for (tenant, pool), c in list(self._tokens.counts.items()):
            family.add_metric([tenant, pool, "prompt"], c[1])
            family.add_metric([tenant, pool, "cached"], c[2])
        yield family


def _no_errors(replica_id: str) -> int:
    return 0


class _Registry(CollectorRegistry):
    """A registry that keeps apart the collectors read at scrape time (in flight, health,
    queue depth, Redis's state: a few series per pool, replica or process), so they can be
    rendered alone (`GatewayMetrics.render_state`) without the per-request counters and
    histograms, which may hold thousands of series."""

    def __init__(self) -> None:
        super().__init__(auto_describe=False)
        self.state: list[Collector] = []

    def register(self, collector: Collector) -> None:
        super().register(collector)
        if not isinstance(collector, MetricWrapperBase):
            self.state.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        if collector in self.state:
            self.state.remove(collector)


class _StateView:
    """The state collectors of a `_Registry`, as `generate_latest` reads a registry."""

    def __init__(self, registry: _Registry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for collector in list(self._registry.state):
            yield from collector.collect()


class GatewayMetrics:
    """The registry and the hot path's recording calls (labelled children cached).

    `replicas()` yields every replica to describe (draining ones included), `scrape_errors`
    answers a replica's failed scrapes, `affinity()` the router's index size per replica and
    `pools()` the names of the pools in force.
    """

    def __init__(
        self, replicas: Callable[[], Iterable[Replica]], clock: Callable[[], float],
        *, scrape_errors: Callable[[str], int] = _no_errors,
        affinity: Callable[[], dict[str, int]] = dict,
        pools: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        # No `*_created` series: they double the page and no query here reads them (vLLM turns
        # them off too). The switch is the library's, process-wide; kvgate wants it everywhere.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = _Registry()
        self.render_all: Callable[[], bytes] | None = None  # every worker's (`render`)
        reg = self.registry
        self.requests = Counter(
            "kvgate_requests_total", "finished proxied requests",
            ["pool", "replica", "tier", "tenant", "status", "route"], registry=reg,
        )
        # per API (the route's fixed kind name, never its path): a counter of its own, since
        # `route` on kvgate_requests_total is the router's reason (docs/metrics.md)
        self.api_requests = Counter(
            "kvgate_api_requests_total", "finished proxied requests per API (chat, messages, "
            "tokenize, rerank, transcription, ...)", ["pool", "api", "status"], registry=reg,
        )
        self.duration = Histogram(
            "kvgate_request_duration_seconds", "end-to-end latency as the client sees it",
            ["pool", "tier"], buckets=LATENCY_BUCKETS, registry=reg,
        )
        self.ttft = Histogram(
            "kvgate_ttft_seconds", "time to the first streamed chunk carrying content",
            ["pool", "tier"], buckets=LATENCY_BUCKETS, registry=reg,
        )
        self.itl = Histogram(
            "kvgate_inter_token_latency_seconds", "time between streamed chunks sent to the client",
            ["pool"], buckets=ITL_BUCKETS, registry=reg,
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
        self.retries_refused = Counter(
            "kvgate_upstream_retries_refused_total",
            "failed tries not retried though another replica could have answered: the retry "
            "budget allowed none (budget), the answer had already started to reach the client "
            "while another replica of the pool took requests (started), or flow control's "
            "in-flight bound left no replica room (flow)",
            ["pool", "why"], registry=reg,
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
        self.unread_answers = Counter(
            "kvgate_unread_answers_total",
            "connections reset: the client kept them open without reading an answer written "
            "in full", registry=reg,
        )
        reg.register(_ReplicaCollector(replicas, clock, scrape_errors, affinity, pools))
        self.tenant_tokens = TenantTokens()
        reg.register(_TenantTokensCollector(self.tenant_tokens))
        # pool -> [finished requests, 5xx (flow control's sheds aside: they are the doctor's
        # queue-bound, not errors), overflow routes, spilled out]: the same counts as the
        # labelled counters, per pool only, so `kvgate doctor` reads them without collecting
        # thousands of (replica, tier, tenant, status, route) children
        self.pool_counts: dict[str, list[int]] = {}
        # pool -> requests its replicas answered with a 4xx (400: a prompt past the context
        # length, a bad parameter): the doctor's, which the 5xx count leaves out
        self.pool_refused: dict[str, int] = {}
        # what else keeps series per pool (flow control's): told when a pool is forgotten
        self.pool_forgetters: list[Callable[[str], None]] = []
        self._children: dict[tuple[Any, ...], Any] = {}
        # id(metric) -> (metric, the positions of its labels that name a pool)
        self._pool_labels: dict[int, tuple[Any, tuple[int, ...]]] = {
            id(m): (m, (0,)) for m in (self.requests, self.api_requests, self.duration,
                                       self.ttft, self.itl, self.tokens, self.retries,
                                       self.failovers, self.retries_refused)}
        self._pool_labels[id(self.spillovers)] = (self.spillovers, (1, 2))
        self.pre_upstream = self.overhead.labels("pre_upstream")
        self.relay = self.overhead.labels("relay")

    def _child(self, metric: Any, labels: tuple[str, ...]) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def finished(
        self, pool: str, replica: str, status: int, route: str, duration_s: float,
        tier: str = "default", tenant: str = "default", api: str = "chat",
    ) -> None:
        self._child(self.requests, (pool, replica, tier, tenant, str(status), route)).inc()
        self._child(self.api_requests, (pool, api, str(status))).inc()
        self._child(self.duration, (pool, tier)).observe(duration_s)
        c = self.pool_counts.get(pool)
        if c is None:
            c = self.pool_counts[pool] = [0, 0, 0, 0]
        c[0] += 1
        if status >= 500 and route != "shed":  # flow control's overload 503: queue-bound
            c[1] += 1
        if route == "overflow":
            c[2] += 1
        if replica != "none" and 400 <= status < 499 and status not in (408, 429):
            self.pool_refused[pool] = self.pool_refused.get(pool, 0) + 1

    def forget_replica(self, pool: str, replica: str) -> None:
        """Drop the `kvgate_requests_total` series of `replica` in `pool` (it left and has
        drained): a fleet whose replicas come and go -- a new pod address at every rollout --
        kept a series set for every address it ever served from."""
        requests = id(self.requests)
        for key in [k for k in self._children if k[0] == requests and k[1:3] == (pool, replica)]:
            del self._children[key]
            self.requests.remove(*key[1:])

    def forget_pool(self, pool: str) -> None:
        """Drop every series of `pool` (a policy version removed it, and it has lingered):
        its labelled children, its usage per tenant and its counts for `kvgate doctor`."""
        for key in list(self._children):
            found = self._pool_labels.get(key[0])
            if found is not None and any(key[1 + i] == pool for i in found[1]):
                del self._children[key]
                found[0].remove(*key[1:])
        self.pool_counts.pop(pool, None)
        self.pool_refused.pop(pool, None)
        self.tenant_tokens.forget_pool(pool)
        for forget in self.pool_forgetters:
            forget(pool)

    def first_token(self, pool: str, ttft_s: float, tier: str = "default") -> None:
        self._child(self.ttft, (pool, tier)).observe(ttft_s)

    def itl_child(self, pool: str) -> Any:
        """The inter-token histogram of `pool` (the relay loop observes it per chunk)."""
        return self._child(self.itl, (pool,))

    def usage(
        self, pool: str, usage: dict[str, int], tier: str = "default", tenant: str = "default"
    ) -> None:
        self.tenant_tokens.add(tenant, pool, usage)
        for key, kind in (("prompt_tokens", "prompt"), ("completion_tokens", "completion"),
                          ("cached_tokens", "cached")):
            n = usage.get(key)
            if n:
                self._child(self.tokens, (pool, tier, kind)).inc(n)

    def retried(self, pool: str, reason: str) -> None:
        self._child(self.retries, (pool, reason)).inc()

    def retry_refused(self, pool: str, why: str) -> None:
        """A failed try not retried (`retries_refused`'s `why`: budget, started, flow)."""
        self._child(self.retries_refused, (pool, why)).inc()

    def failover(self, pool: str) -> None:
        self._child(self.failovers, (pool,)).inc()

    def rejected(self, tier: str, tenant: str, limit: str) -> None:
        self._child(self.rejections, (tier, tenant, limit)).inc()

    def spilled(self, tier: str, from_pool: str, to_pool: str) -> None:
        self._child(self.spillovers, (tier, from_pool, to_pool)).inc()
        c = self.pool_counts.get(from_pool)
        if c is None:
            c = self.pool_counts[from_pool] = [0, 0, 0, 0]
        c[3] += 1

    def watch_tenancy(self, state: Callable[[], tuple[bool | None, int]],
                      cause: Callable[[], str | None]) -> None:
        """Export the tenancy state: `state()` -> (Redis up or None without Redis, version);
        `cause()` -> why Redis is not up (one of `CAUSE_LABELS`)."""
        self.registry.register(_TenancyCollector(state, cause))

    def render(self) -> bytes:
        """What /metrics answers: this process's series, or with `server.workers` > 1 every
        worker's (`gateway.worker_metrics`, set by the runtime)."""
        return self.render_all() if self.render_all is not None else self.render_own()

    def render_own(self) -> bytes:
        return generate_latest(self.registry)

    def render_state(self) -> bytes:
        """The series read at scrape time only (`_Registry`): what a worker of several writes
        every second for the others' scrapes, however long its whole page takes."""
        return generate_latest(_StateView(self.registry))
