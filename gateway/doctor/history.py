"""The doctor's rolling history: one compact tick every ``interval_s``, kept for ``history_s``.

A tick is a snapshot of what the gateway already holds, never of requests: per replica its
last scrape (the engine's gauges and cumulative counters), kvgate's in-flight count, health,
scrape age and errors, requests sent there and failed there and the router's learned prefill
rate; per pool kvgate's cumulative
request, route, spill-over, usage and client-side TTFT counters and the sampled prefix-sharing
sums (`sharing.py`); for the process its CPU time, kvgate's overhead histogram and the Redis /
shared-state flags; every `TENANT_EVERY` ticks the per-tenant token counters. Numbers are
packed in one ``array('d')`` per tick (NaN = unknown), so the history's size is fixed by
(history_s / interval_s) x (replicas, pools) and does not grow with the request rate.

Counters are cumulative, so a window's increase is read from its first and last ticks (resets,
e.g. an engine restart, are handled in `window.py`). The history lives in the process: a
restart starts a new one, and with ``server.workers`` > 1 each worker keeps its own.
`Sampler` is the task the app's lifespan owns (`start`, `stop`); `read_tick` is also called
at report time so a report always ends "now".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gateway.doctor.sharing import PrefixSharing
from gateway.metrics import LATENCY_BUCKETS, OVERHEAD_BUCKETS, GatewayMetrics
from gateway.replicas import Replica
from gateway.tenancy.redis_conn import CAUSE_LABELS
from routing.router import Router

__all__ = [
    "GW", "POOL", "REP", "TENANT_EVERY", "TTFT_BOUNDS", "History", "Layout", "Sampler", "Sources",
    "Tick", "read_tick",
]

log = logging.getLogger(__name__)

NAN = math.nan
TENANT_EVERY = 10  # per-tenant counters are kept every 10th tick (cache windows are minutes)
TTFT_BOUNDS = (*LATENCY_BUCKETS, math.inf)
OVERHEAD_BOUNDS = (*OVERHEAD_BUCKETS, math.inf)


class REP:
    """Field offsets of one replica's numbers in a tick."""

    HEALTHY, DRAINING, INFLIGHT, SCRAPE_AGE, SCRAPE_ERRORS, PREFILL_RATE, NO_STATS = range(7)
    ATTEMPTS, FAILED = 7, 8  # kvgate's requests sent there and failed there (cumulative)
    WAITING, RUNNING, KV, PREEMPTIONS, QUERIES, HITS, PROMPT, GENERATION = range(9, 17)
    TTFT_SUM, TTFT_COUNT, ITL_SUM, ITL_COUNT, QUEUE_SUM, QUEUE_COUNT, CAPACITY = range(17, 24)
    STALLS, STALLED = 24, 25  # times found stalled (cumulative); 1 while stalled (gateway.stall)
    # the age of the oldest request of kvgate's waiting there for its first event, and a
    # count that moves whenever anything came back from its engine (`ReplicaState.returned`)
    OLDEST_WAIT, RETURNED = 26, 27
    N = 28


class POOL:
    """Field offsets of one pool's numbers; the client-side TTFT and end-to-end latency
    buckets follow at TTFT and E2E."""

    REQUESTS, ERRORS, OVERFLOW, SPILLED, PROMPT, CACHED = range(6)
    SHARE_N, SHARE_PROMPT, SHARE_BEST, SHARE_CHOSEN = range(6, 10)
    FLOW_QUEUED, FLOW_DEPTH = 10, 11  # flow control: requests queued so far, queued now
    FLOW_SHED = 12  # ... and requests it shed so far (kvgate_flow_shed_total: 503 or 429)
    REFUSED = 13  # requests its replicas answered with a 4xx (`GatewayMetrics.pool_refused`)
    TTFT = 14
    E2E = TTFT + len(TTFT_BOUNDS)
    N = E2E + len(TTFT_BOUNDS)


class GW:
    """Field offsets of the process's numbers; the overhead buckets follow at OVERHEAD."""

    CPU, REDIS_UP, SYNC_DEGRADED, TENANCY_LOADED, REDIS_CAUSE, SYNC_CAUSE = range(6)
    OVERHEAD = 6
    N = OVERHEAD + len(OVERHEAD_BOUNDS)


class Layout:
    """Which replica and pool sits where in a tick's arrays (shared while nothing changes)."""

    __slots__ = ("_ppos", "_rpos", "pools", "replica_pools", "replicas")

    def __init__(
        self, replicas: tuple[str, ...], replica_pools: tuple[str, ...], pools: tuple[str, ...]
    ) -> None:
        self.replicas = replicas
        self.replica_pools = replica_pools
        self.pools = pools
        self._rpos = {r: i for i, r in enumerate(replicas)}
        self._ppos = {p: i for i, p in enumerate(pools)}

    def replica(self, rid: str) -> int | None:
        return self._rpos.get(rid)

    def pool(self, name: str) -> int | None:
        return self._ppos.get(name)


@dataclass(frozen=True, slots=True)
class Tick:
    t: float  # the gateway's monotonic clock
    wall: float  # time.time(), for the report's dates
    layout: Layout
    replicas: array[float]  # Layout.replicas x REP.N doubles
    pools: array[float]  # Layout.pools x POOL.N doubles
    gateway: array[float]  # GW.N doubles
    # every TENANT_EVERY ticks only: the (tenant label, pool) keys (shared while unchanged)
    # and per key 4 numbers: requests with usage, prompt tokens, cached tokens, requests whose
    # usage reported cached_tokens
    tenant_keys: tuple[tuple[str, str], ...] | None = None
    tenant_values: array[float] | None = None
    # the same ticks: the rate limiter's 429s so far per (tier, tenant label, limit)
    limited: tuple[tuple[str, str, str, float], ...] | None = None

    def tenants(self) -> dict[tuple[str, str], tuple[float, ...]] | None:
        if self.tenant_keys is None or self.tenant_values is None:
            return None
        v = self.tenant_values
        return {k: tuple(v[i * 4:i * 4 + 4]) for i, k in enumerate(self.tenant_keys)}

    def replica(self, rid: str, field: int) -> float:
        i = self.layout.replica(rid)
        return NAN if i is None else self.replicas[i * REP.N + field]

    def pool(self, name: str, field: int) -> float:
        i = self.layout.pool(name)
        return NAN if i is None else self.pools[i * POOL.N + field]


@dataclass
class Sources:
    """What a tick reads: the gateway's own objects (the app builds this)."""

    replicas: Callable[[], Iterable[Replica]]  # every described replica, draining included
    metrics: GatewayMetrics
    router: Router
    sharing: PrefixSharing
    scrape_errors: Callable[[str], int]
    redis_up: Callable[[], bool | None]  # tenancy store; None without Redis
    sync_degraded: Callable[[], bool | None]  # shared routing state; None when off
    cpu: Callable[[], float] = time.process_time
    # tenants and policy loaded at least once (False: Redis never answered since start)
    tenancy_loaded: Callable[[], bool | None] = lambda: None
    # the replica's last /metrics page answered without vllm:* series (--disable-log-stats)
    no_load_data: Callable[[str], bool] = lambda rid: False
    # why Redis fails now (one of `redis_conn.CAUSE_LABELS`; None while it answers): the
    # tenancy store's and the shared routing state's
    redis_cause: Callable[[], str | None] = lambda: None
    sync_cause: Callable[[], str | None] = lambda: None
    # flow control per pool: (requests queued so far, queued now, shed so far); None: off
    flow: Callable[[], Mapping[str, tuple[float, float, float]]] | None = None
    # the leases' clock (`Lease.since`: monotonic), for the oldest wait for a first event
    lease_clock: Callable[[], float] = time.monotonic


def _flag(value: bool | None) -> float:
    return NAN if value is None else (1.0 if value else 0.0)


def _cause(label: str | None) -> float:
    """A cause label as a tick's number: its index in `CAUSE_LABELS`, NaN for none."""
    return NAN if label is None else float(CAUSE_LABELS.index(label))


def _opt(value: float | None) -> float:
    return NAN if value is None else float(value)


def _pool_counters(metrics: GatewayMetrics) -> dict[str, list[float]]:
    """Per pool: requests, 5xx, overflow routes, spilled out (`GatewayMetrics.pool_counts`),
    usage prompt and cached tokens (summed over `GatewayMetrics.tenant_tokens`) and the
    client-side TTFT and latency buckets (cumulative; the histograms have one child per pool
    and tier, so collecting them is cheap)."""
    out: dict[str, list[float]] = {}

    def row(pool: str) -> list[float]:
        r = out.get(pool)
        if r is None:
            r = out[pool] = [0.0] * POOL.N
        return r

    for pool, c in list(metrics.pool_counts.items()):
        r = row(pool)
        r[POOL.REQUESTS], r[POOL.ERRORS], r[POOL.OVERFLOW], r[POOL.SPILLED] = map(float, c)
    for pool, n in list(metrics.pool_refused.items()):
        row(pool)[POOL.REFUSED] = float(n)
    for (_, pool), c in list(metrics.tenant_tokens.counts.items()):
        r = row(pool)
        r[POOL.PROMPT] += c[1]
        r[POOL.CACHED] += c[2]
    index = {b: i for i, b in enumerate(TTFT_BOUNDS)}
    for histogram, offset in ((metrics.ttft, POOL.TTFT), (metrics.duration, POOL.E2E)):
        for family in histogram.collect():
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    i = index.get(float(s.labels["le"]))
                    if i is not None:
                        row(s.labels["pool"])[offset + i] += s.value
    return out


def _overhead(metrics: GatewayMetrics) -> list[float]:
    buckets = [0.0] * len(OVERHEAD_BOUNDS)
    index = {b: i for i, b in enumerate(OVERHEAD_BOUNDS)}
    for family in metrics.overhead.collect():
        for s in family.samples:
            if s.name.endswith("_bucket") and s.labels.get("phase") == "pre_upstream":
                i = index.get(float(s.labels["le"]))
                if i is not None:
                    buckets[i] += s.value
    return buckets


def _rejections(metrics: GatewayMetrics) -> tuple[tuple[str, str, str, float], ...]:
    """`kvgate_ratelimit_rejections_total` per (tier, tenant label, limit): the 429s a
    tenant's own limits sent (read with the tenant counters: a child per tenant and limit)."""
    out = []
    for family in metrics.rejections.collect():
        for s in family.samples:
            if s.name.endswith("_total"):
                lb = s.labels
                out.append((lb["tier"], lb["tenant"], lb["limit"], float(s.value)))
    return tuple(out)


def read_tick(
    src: Sources, now: float, previous: Layout | None, tenants: bool,
    tenant_keys: tuple[tuple[str, str], ...] | None = None,
) -> Tick:
    """One snapshot of the gateway's state (cheap: no request is looked at)."""
    replicas = list(src.replicas())
    counters = _pool_counters(src.metrics)
    pool_names = tuple(sorted({r.pool for r in replicas} | set(counters) - {"none"}))
    ids = tuple(r.id for r in replicas)
    rpools = tuple(r.pool for r in replicas)
    layout = previous
    if layout is None or layout.replicas != ids or layout.replica_pools != rpools \
            or layout.pools != pool_names:
        layout = Layout(ids, rpools, pool_names)
    rate = src.router.prefill_rate
    rdata = array("d")
    mono = src.lease_clock()
    for r in replicas:
        s = r.scraped
        rdata.extend((
            0.0 if r.draining or not r.available(now) else 1.0,
            1.0 if r.draining else 0.0,
            float(r.inflight),
            NAN if s is None else now - r.scraped_at,
            float(src.scrape_errors(r.id)),
            rate(r.id),
            1.0 if src.no_load_data(r.id) else 0.0,
            float(r.attempts),
            float(r.failed),
        ))
        if s is None:
            rdata.extend([NAN] * (REP.STALLS - REP.WAITING))
        else:
            rdata.extend((
                _opt(s.waiting), _opt(s.running), _opt(s.kv_usage), _opt(s.preemptions),
                _opt(s.prefix_cache_queries), _opt(s.prefix_cache_hits), _opt(s.prompt_tokens),
                _opt(s.generation_tokens), _opt(s.ttft_sum), _opt(s.ttft_count),
                _opt(s.itl_sum), _opt(s.itl_count), _opt(s.queue_time_sum),
                _opt(s.queue_time_count), _opt(s.cache_capacity_tokens),
            ))
        rdata.extend((float(r.stalls), 1.0 if r.stalled else 0.0, r.oldest_wait_s(mono),
                      r.returned()))
    pdata = array("d")
    sharing = src.sharing.pools
    flow = src.flow() if src.flow is not None else None
    for name in pool_names:
        row = counters.get(name) or [0.0] * POOL.N
        share = sharing.get(name)
        if share is not None:
            row[POOL.SHARE_N:POOL.SHARE_CHOSEN + 1] = [float(v) for v in share]
        queued = (NAN, NAN, NAN) if flow is None else flow.get(name, (0.0, 0.0, 0.0))
        row[POOL.FLOW_QUEUED], row[POOL.FLOW_DEPTH], row[POOL.FLOW_SHED] = queued
        pdata.extend(row)
    gdata = array("d", (src.cpu(), _flag(src.redis_up()), _flag(src.sync_degraded()),
                        _flag(src.tenancy_loaded()), _cause(src.redis_cause()),
                        _cause(src.sync_cause())))
    gdata.extend(_overhead(src.metrics))
    keys = values = limited = None
    if tenants:
        limited = _rejections(src.metrics)
        counts = list(src.metrics.tenant_tokens.counts.items())
        keys = tuple(k for k, _ in counts)
        if keys == tenant_keys:
            keys = tenant_keys  # the previous tick's tuple, shared
        values = array("d")
        for _, c in counts:
            values.extend(c)
    return Tick(now, time.time(), layout, rdata, pdata, gdata, keys, values, limited)


class History:
    """The ticks of the last ``history_s`` seconds, oldest first."""

    def __init__(self, interval_s: float, history_s: float) -> None:
        self.interval_s = interval_s
        self.history_s = history_s
        self.ticks: deque[Tick] = deque(maxlen=max(2, math.ceil(history_s / interval_s) + 1))
        self.started_wall = time.time()  # a restart starts a new history
        self.count = 0

    def append(self, tick: Tick) -> None:
        self.ticks.append(tick)
        self.count += 1

    def want_tenants(self) -> bool:
        return self.count % TENANT_EVERY == 0

    @property
    def layout(self) -> Layout | None:
        return self.ticks[-1].layout if self.ticks else None

    def tenant_keys(self) -> tuple[tuple[str, str], ...] | None:
        for tick in reversed(self.ticks):
            if tick.tenant_keys is not None:
                return tick.tenant_keys
        return None


class Sampler:
    """The lifespan-owned task appending a tick every ``interval_s`` (never raises)."""

    def __init__(self, src: Sources, history: History, clock: Callable[[], float]) -> None:
        self.src = src
        self.history = history
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    def tick(self) -> Tick:
        h = self.history
        want = h.want_tenants()
        tick = read_tick(self.src, self._clock(), h.layout, want,
                         h.tenant_keys() if want else None)
        h.append(tick)
        return tick

    def now(self) -> Tick:
        """A tick of the current state, not kept (a report ends with it); it carries the
        tenant counters."""
        return read_tick(self.src, self._clock(), self.history.layout, True)

    async def start(self) -> None:
        self.tick()
        self._task = asyncio.create_task(self._run(), name="kvgate-doctor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        interval = self.history.interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                self.tick()
            except Exception:  # a bad tick must not end the history
                log.exception("doctor sample failed")
