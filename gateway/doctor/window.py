"""A window of the history reduced to numbers: per replica, per pool, for the process and per
tenant (pure functions over ticks; no clock, no I/O).

The window is the ticks after the last tick at or before ``end - window_s`` (that tick is the
baseline counters are measured from). Gauges (waiting, running, KV usage, in flight) are
summarised over the window's ticks; counters are increases, summed step by step so that a
counter that went backwards (an engine restart, a replica that rejoined) counts from zero
again instead of going negative, as Prometheus' ``increase`` does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from gateway.doctor.history import GW, OVERHEAD_BOUNDS, POOL, REP, TTFT_BOUNDS, Tick
from gateway.doctor.tenant_limits import LimitStats, limited_stats
from gateway.tenancy.redis_conn import CAUSE_LABELS

__all__ = [
    "GatewayStats", "PoolStats", "ReplicaStats", "TenantStats", "Window", "histogram_quantile",
    "increase", "summarise",
]


def increase(values: Sequence[float]) -> float:
    """Increase of a cumulative counter over consecutive readings (NaN = not read)."""
    total = 0.0
    last = math.nan
    for v in values:
        if math.isnan(v):
            continue
        if not math.isnan(last):
            total += v - last if v >= last else v
        last = v
    return total


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan


def histogram_quantile(q: float, bounds: Sequence[float], cumulative: Sequence[float]) -> float:
    """Prometheus' histogram_quantile over cumulative bucket counts (``le`` order); a rank in
    the +Inf bucket answers the highest finite bound."""
    total = cumulative[-1] if cumulative else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in zip(bounds, cumulative, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


@dataclass
class ReplicaStats:
    id: str
    pool: str
    samples: int = 0  # ticks in the window where the replica was listed
    span_s: float = 0.0  # seconds of the window it was listed for
    fresh: int = 0  # of those, with a scrape younger than routing.stale_after_s
    healthy_share: float = math.nan  # of samples, taking requests (not ejected nor draining)
    healthy_last: float = math.nan  # the last sample: 1 takes requests, 0 not
    outages: float = 0.0  # times it went out of rotation after FLAP_IN_SAMPLES in it
    draining: bool = False
    inflight_mean: float = math.nan
    inflight_max: float = math.nan
    waiting_share: float = math.nan  # of fresh samples, waiting > 0
    waiting_mean: float = math.nan
    running_mean: float = math.nan
    running_max: float = math.nan
    running_when_waiting: float = math.nan  # highest running count while requests waited
    kv_p90: float = math.nan
    kv_mean: float = math.nan
    kv_max: float = math.nan
    preemptions: float = 0.0
    queries: float = 0.0
    hits: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    requests: float = math.nan  # engine TTFT observations (requests that started)
    ttft_mean: float = math.nan
    itl_mean: float = math.nan
    itl_n: float = 0.0
    queue_mean: float = math.nan
    scrape_errors: float = 0.0
    attempts: float = 0.0  # kvgate's requests sent here in the window, retries included
    failed: float = 0.0  # of which failed here (the retries hide them from clients)
    stalls: float = 0.0  # times kvgate found its engine stalled in the window (gateway.stall)
    stalled_last: bool = False  # ... and whether it still was at the last sample
    # seconds at the window's end its engine held requests running while its token counters
    # (generation and prompt) did not move: a hung engine, before gateway.stall ejects it
    frozen_s: float = 0.0
    frozen_running: float = math.nan  # the running count over that time (its mean)
    # at the window's end: the oldest request of kvgate's waiting there for its first event
    # (kvgate_replica_oldest_wait_seconds), and how long nothing came back from its engine (no
    # first event, whole answer, streamed event or token counted: `ReplicaState.returned`)
    waited_s: float = 0.0
    quiet_s: float = 0.0
    no_stats: bool = False  # the last scrape: /metrics answered without vllm:* series
    stale_share: float = math.nan
    prefill_rate: float = math.nan  # tokens/s, the router's learned rate (last tick)
    # why kvgate holds it out of rotation now (`Replica.reason`: its /health's answer, another
    # model served, its credentials refused, ...), set at report time: ticks keep numbers only
    reason: str = ""
    max_model_len: float = math.nan  # its context length (/v1/models), also set at report time
    capacity_tokens: float = math.nan

    @property
    def hit_rate(self) -> float:
        return _ratio(self.hits, self.queries)

    @property
    def mean_prompt(self) -> float:
        return _ratio(self.prompt_tokens, self.requests)

    @property
    def time_per_request(self) -> float:
        """Seconds a request spends in flight here, by Little's law (mean in flight /
        requests per second): kvgate's whole view of the replica, network included."""
        return _ratio(self.inflight_mean, _ratio(self.requests, self.span_s))


@dataclass
class PoolStats:
    name: str
    samples: int = 0  # ticks in the window
    requests: float = 0.0
    errors: float = 0.0
    refused: float = 0.0  # answered with a 4xx by its replicas (the request invalid there)
    overflow: float = 0.0
    spilled: float = 0.0
    prompt_tokens: float = 0.0  # from upstream usage
    cached_tokens: float = 0.0
    share_n: float = 0.0  # sampled routing decisions (sharing.py)
    share_prompt: float = 0.0
    share_best: float = 0.0
    share_chosen: float = 0.0
    ttft_p90_client: float = math.nan  # kvgate_ttft_seconds, as clients see it (streams)
    ttft_n_client: float = 0.0
    e2e_p90_client: float = math.nan  # kvgate_request_duration_seconds
    flow_queued: float = math.nan  # requests that waited in flow control's queue (NaN: off)
    flow_depth_mean: float = math.nan  # requests in that queue, mean over the window's ticks
    flow_wait_mean: float = math.nan  # s a queued request waited (Little's law on the queue)
    flow_shed: float = math.nan  # requests flow control shed (503, or 429 past a tier's wait)
    replicas: list[ReplicaStats] = field(default_factory=list)
    # the same over the window's second half (its routing sample, its engines' prefix-cache
    # hits and queries): a hit rate that collapses mid-window shows there, where the whole
    # window's average, half of it from before, hid it. None on the half itself.
    recent: PoolStats | None = None
    span_s: float = 0.0  # seconds its ticks cover

    @property
    def engine_hit_rate(self) -> float:
        return _ratio(sum(r.hits for r in self.replicas), sum(r.queries for r in self.replicas))

    @property
    def potential_hit_rate(self) -> float:
        return _ratio(self.share_best, self.share_prompt)

    @property
    def routed_hit_rate(self) -> float:
        return _ratio(self.share_chosen, self.share_prompt)


@dataclass
class GatewayStats:
    cpu_share: float = math.nan  # CPU seconds per wall second of this process
    overhead_p99: float = math.nan
    overhead_n: float = 0.0
    redis_up: float = math.nan  # last tick: 1, 0, NaN (no Redis)
    redis_down_s: float = 0.0
    tenancy_loaded: float = math.nan  # last tick: 1, 0 (nothing loaded yet), NaN (unknown)
    sync_degraded: float = math.nan  # last tick: 1, 0, NaN (no shared routing state)
    sync_degraded_s: float = 0.0
    # why each failed, now or last in the window (one of `redis_conn.CAUSE_LABELS`)
    redis_cause: str | None = None
    sync_cause: str | None = None


@dataclass
class TenantStats:
    tenant: str
    pool: str
    requests: float
    prompt_tokens: float
    cached_tokens: float
    cached_reported: float  # requests whose usage carried cached_tokens


@dataclass
class Window:
    requested_s: float
    span_s: float  # what the history covers of it (less just after a start)
    start_wall: float
    end_wall: float
    ticks: int
    replicas: list[ReplicaStats]
    pools: list[PoolStats]
    gateway: GatewayStats
    tenants: list[TenantStats]
    tenant_span_s: float
    limited: list[LimitStats] = field(default_factory=list)  # the rate limiter's 429s


def _baseline(ticks: Sequence[Tick], start: float) -> int:
    """Index of the last tick at or before ``start`` (0 when the history is younger)."""
    lo, hi = 0, len(ticks) - 1
    best = 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if ticks[mid].t <= start:
            best = mid
            lo = mid + 1
        else:
            hi = mid - 1
    return best


FLAP_IN_SAMPLES = 2  # in rotation this many samples before going out: an outage


def _outages(healthy: Sequence[float]) -> float:
    """How many times the replica went out of rotation after being in it for at least
    `FLAP_IN_SAMPLES` samples: a replica ejected then tried again (a sample in between, its
    trial) counts once, one flapping up and down once per fall."""
    n, run = 0, 0
    for v in healthy:
        if math.isnan(v):
            continue
        if v > 0:
            run += 1
            continue
        n += run >= FLAP_IN_SAMPLES
        run = 0
    return float(n)


def _replica_stats(rid: str, pool: str, span: Sequence[Tick], stale_after_s: float) -> ReplicaStats:
    st = ReplicaStats(rid, pool)
    series: dict[int, list[float]] = {f: [] for f in range(REP.N)}
    for tick in span:
        i = tick.layout.replica(rid)
        if i is None:
            for f in series:
                series[f].append(math.nan)
            continue
        base = i * REP.N
        row = tick.replicas
        for f in range(REP.N):
            series[f].append(row[base + f])
    window = span[1:]  # gauges: the ticks after the baseline
    present = [j + 1 for j, tick in enumerate(window) if tick.layout.replica(rid) is not None]
    st.samples = len(present)
    if not present:
        return st
    st.span_s = sum(span[j].t - span[j - 1].t for j in present)

    def gauge(f: int, keep: list[int]) -> list[float]:
        return [v for j in keep if not math.isnan(v := series[f][j])]

    ages = series[REP.SCRAPE_AGE]
    fresh = [j for j in present if not math.isnan(ages[j]) and ages[j] <= stale_after_s]
    st.fresh = len(fresh)
    st.stale_share = 1.0 - len(fresh) / len(present)
    st.healthy_share = _mean(gauge(REP.HEALTHY, present))
    st.healthy_last = series[REP.HEALTHY][present[-1]]
    st.outages = _outages([series[REP.HEALTHY][j] for j in [0, *present]])
    st.draining = series[REP.DRAINING][present[-1]] > 0
    inflight = gauge(REP.INFLIGHT, present)
    st.inflight_mean, st.inflight_max = _mean(inflight), max(inflight, default=math.nan)
    waiting = gauge(REP.WAITING, fresh)
    running = gauge(REP.RUNNING, fresh)
    kv = gauge(REP.KV, fresh)
    if waiting:
        st.waiting_share = sum(1 for w in waiting if w > 0) / len(waiting)
        st.waiting_mean = _mean(waiting)
        busy = [series[REP.RUNNING][j] for j in fresh if series[REP.WAITING][j] > 0]
        st.running_when_waiting = max((v for v in busy if not math.isnan(v)), default=math.nan)
    if running:
        st.running_mean, st.running_max = _mean(running), max(running)
    if kv:
        st.kv_p90, st.kv_mean, st.kv_max = _quantile(kv, 0.9), _mean(kv), max(kv)
    inc = {f: increase(series[f]) for f in (
        REP.PREEMPTIONS, REP.QUERIES, REP.HITS, REP.PROMPT, REP.GENERATION, REP.TTFT_SUM,
        REP.TTFT_COUNT, REP.ITL_SUM, REP.ITL_COUNT, REP.QUEUE_SUM, REP.QUEUE_COUNT,
        REP.SCRAPE_ERRORS, REP.ATTEMPTS, REP.FAILED, REP.STALLS)}
    st.preemptions, st.queries, st.hits = inc[REP.PREEMPTIONS], inc[REP.QUERIES], inc[REP.HITS]
    st.prompt_tokens, st.generation_tokens = inc[REP.PROMPT], inc[REP.GENERATION]
    if any(not math.isnan(v) for v in series[REP.TTFT_COUNT]):
        st.requests = inc[REP.TTFT_COUNT]
    st.ttft_mean = _ratio(inc[REP.TTFT_SUM], inc[REP.TTFT_COUNT])
    st.itl_n = inc[REP.ITL_COUNT]
    st.itl_mean = _ratio(inc[REP.ITL_SUM], inc[REP.ITL_COUNT])
    st.queue_mean = _ratio(inc[REP.QUEUE_SUM], inc[REP.QUEUE_COUNT])
    st.scrape_errors = inc[REP.SCRAPE_ERRORS]
    st.attempts, st.failed = inc[REP.ATTEMPTS], inc[REP.FAILED]
    st.stalls = inc[REP.STALLS]
    st.stalled_last = series[REP.STALLED][present[-1]] > 0
    st.no_stats = series[REP.NO_STATS][present[-1]] > 0
    st.frozen_s, st.frozen_running = _frozen_tail(span, series)
    st.waited_s, st.quiet_s = _waiting_tail(span, series)
    last = present[-1]
    st.prefill_rate = series[REP.PREFILL_RATE][last]
    caps = gauge(REP.CAPACITY, present)
    st.capacity_tokens = caps[-1] if caps else math.nan
    return st


def _cache_counters(rid: str, pool: str, span: Sequence[Tick]) -> ReplicaStats:
    """A replica's prefix-cache queries and hits over ``span`` (all a pool's hit rate reads)."""
    st = ReplicaStats(rid, pool)
    queries, hits = [], []
    for tick in span:
        i = tick.layout.replica(rid)
        if i is None:
            queries.append(math.nan)
            hits.append(math.nan)
        else:
            queries.append(tick.replicas[i * REP.N + REP.QUERIES])
            hits.append(tick.replicas[i * REP.N + REP.HITS])
    st.queries, st.hits = increase(queries), increase(hits)
    return st


def _frozen_tail(span: Sequence[Tick], series: dict[int, list[float]]) -> tuple[float, float]:
    """Seconds at the end of the window over which the engine held requests (running or
    waiting) and its generation and prompt token counters stood still, and the mean count of
    requests it held over them. Measured between the scrapes' own times (a tick's time less
    its scrape's age): from the first scrape showing the counters' final values to the last
    scrape. A tick that repeats an older scrape (the scraper or the sampler late on a busy
    host) adds no time, and a late last scrape shortens the count to what was seen, instead of
    voiding it. It counted from the ticks' times and needed requests *running*: an engine hung
    with its requests all waiting (running 0) read as queue-bound."""
    gen, prompt = series[REP.GENERATION], series[REP.PROMPT]
    running, waiting, ages = series[REP.RUNNING], series[REP.WAITING], series[REP.SCRAPE_AGE]

    def held(j: int) -> float:
        return (running[j] if running[j] > 0 else 0.0) + (waiting[j] if waiting[j] > 0 else 0.0)

    last = len(span) - 1
    if math.isnan(ages[last]) or held(last) <= 0:
        return 0.0, math.nan
    j = last
    seats = [held(last)]
    while j >= 1 and held(j - 1) > 0 and gen[j] == gen[j - 1] and prompt[j] == prompt[j - 1] \
            and not math.isnan(ages[j - 1]):
        j -= 1
        seats.append(held(j))
    frozen = (span[last].t - ages[last]) - (span[j].t - ages[j])
    return max(0.0, frozen), _mean(seats)


def _waiting_tail(span: Sequence[Tick], series: dict[int, list[float]]) -> tuple[float, float]:
    """The oldest wait for a first event at the window's last tick, and the seconds back from
    that tick over which nothing came back from the replica (its `returned` count unchanged:
    from the earliest tick of the unbroken run at the last tick's value). Ticks from before
    the replica was listed (NaN) end the run."""
    last = len(span) - 1
    waited, returned = series[REP.OLDEST_WAIT][last], series[REP.RETURNED]
    if math.isnan(waited) or waited <= 0 or math.isnan(returned[last]):
        return 0.0, 0.0
    j = last
    while j >= 1 and returned[j - 1] == returned[last]:
        j -= 1
    return waited, span[last].t - span[j].t


def _pool_stats(name: str, span: Sequence[Tick]) -> PoolStats:
    ps = PoolStats(name)

    def inc(f: int) -> float:
        return increase([t.pool(name, f) for t in span])

    ps.requests, ps.errors = inc(POOL.REQUESTS), inc(POOL.ERRORS)
    ps.refused = inc(POOL.REFUSED)
    ps.overflow, ps.spilled = inc(POOL.OVERFLOW), inc(POOL.SPILLED)
    ps.prompt_tokens, ps.cached_tokens = inc(POOL.PROMPT), inc(POOL.CACHED)
    ps.share_n, ps.share_prompt = inc(POOL.SHARE_N), inc(POOL.SHARE_PROMPT)
    ps.share_best, ps.share_chosen = inc(POOL.SHARE_BEST), inc(POOL.SHARE_CHOSEN)
    buckets = [inc(POOL.TTFT + i) for i in range(len(TTFT_BOUNDS))]
    ps.ttft_n_client = buckets[-1]
    ps.ttft_p90_client = histogram_quantile(0.9, TTFT_BOUNDS, buckets)
    e2e = [inc(POOL.E2E + i) for i in range(len(TTFT_BOUNDS))]
    ps.e2e_p90_client = histogram_quantile(0.9, TTFT_BOUNDS, e2e)
    depth = [v for t in span[1:] if not math.isnan(v := t.pool(name, POOL.FLOW_DEPTH))]
    if depth:
        ps.flow_queued, ps.flow_depth_mean = inc(POOL.FLOW_QUEUED), _mean(depth)
        ps.flow_shed = inc(POOL.FLOW_SHED)
        arrivals = _ratio(ps.flow_queued, span[-1].t - span[0].t)
        ps.flow_wait_mean = _ratio(ps.flow_depth_mean, arrivals)
    return ps


def _hit_counters(name: str, span: Sequence[Tick]) -> PoolStats:
    """A pool's numbers over ``span`` that its hit rate's rule reads (not its latencies)."""
    ps = PoolStats(name)

    def inc(f: int) -> float:
        return increase([t.pool(name, f) for t in span])

    ps.requests, ps.overflow, ps.prompt_tokens = (
        inc(POOL.REQUESTS), inc(POOL.OVERFLOW), inc(POOL.PROMPT))
    ps.share_n, ps.share_prompt = inc(POOL.SHARE_N), inc(POOL.SHARE_PROMPT)
    ps.share_best, ps.share_chosen = inc(POOL.SHARE_BEST), inc(POOL.SHARE_CHOSEN)
    return ps


def _gateway_stats(span: Sequence[Tick]) -> GatewayStats:
    gs = GatewayStats()
    first, last = span[0], span[-1]
    dt = last.t - first.t
    if dt > 0:
        gs.cpu_share = (last.gateway[GW.CPU] - first.gateway[GW.CPU]) / dt
    buckets = [increase([t.gateway[GW.OVERHEAD + i] for t in span])
               for i in range(len(OVERHEAD_BOUNDS))]
    gs.overhead_n = buckets[-1]
    gs.overhead_p99 = histogram_quantile(0.99, OVERHEAD_BOUNDS, buckets)
    gs.redis_up = last.gateway[GW.REDIS_UP]
    gs.tenancy_loaded = last.gateway[GW.TENANCY_LOADED]
    gs.sync_degraded = last.gateway[GW.SYNC_DEGRADED]
    for prev, tick in pairwise(span):
        step = tick.t - prev.t
        if tick.gateway[GW.REDIS_UP] == 0.0:
            gs.redis_down_s += step
            gs.redis_cause = _cause(tick.gateway[GW.REDIS_CAUSE], gs.redis_cause)
        if tick.gateway[GW.SYNC_DEGRADED] == 1.0:
            gs.sync_degraded_s += step
            gs.sync_cause = _cause(tick.gateway[GW.SYNC_CAUSE], gs.sync_cause)
    return gs


def _cause(code: float, before: str | None) -> str | None:
    """A tick's cause (`history._cause`), else the one seen before it."""
    return before if math.isnan(code) else CAUSE_LABELS[int(code)]


def _tenant_stats(ticks: Sequence[Tick], start: float) -> tuple[list[TenantStats], float]:
    with_tenants = [t for t in ticks if t.tenant_keys is not None]
    if len(with_tenants) < 2:
        return [], 0.0
    end = with_tenants[-1]
    base = with_tenants[0]
    for t in with_tenants[:-1]:
        if t.t <= start:
            base = t
    before, after = base.tenants(), end.tenants()
    assert before is not None and after is not None
    out = []
    for key, now in sorted(after.items()):
        then = before.get(key, (0.0, 0.0, 0.0, 0.0))
        d = [a - b for a, b in zip(now, then, strict=True)]
        if d[0] > 0:
            out.append(TenantStats(key[0], key[1], *map(float, d)))
    return out, end.t - base.t


def summarise(ticks: Sequence[Tick], window_s: float, stale_after_s: float) -> Window:
    """Reduce the ticks (oldest first, the last one "now") to one window's numbers."""
    if not ticks:
        raise ValueError("no history yet")
    end = ticks[-1]
    start = end.t - window_s
    span = list(ticks)[_baseline(ticks, start):]
    if len(span) < 2:
        span = [span[0], span[0]]
    rids: dict[str, str] = {}
    for tick in span[1:]:
        for rid, pool in zip(tick.layout.replicas, tick.layout.replica_pools, strict=True):
            rids[rid] = pool
    replicas = [_replica_stats(rid, pool, span, stale_after_s) for rid, pool in rids.items()]
    names = sorted({p for t in span[1:] for p in t.layout.pools} | set(rids.values()))
    late = span[(len(span) - 1) // 2:]  # the second half, from its own baseline tick
    pools = []
    for name in names:
        ps = _pool_stats(name, span)
        ps.samples, ps.span_s = len(span) - 1, end.t - span[0].t
        ps.replicas = [r for r in replicas if r.pool == name]
        ps.recent = _hit_counters(name, late)
        ps.recent.samples, ps.recent.span_s = len(late) - 1, end.t - late[0].t
        ps.recent.replicas = [_cache_counters(r.id, name, late) for r in ps.replicas]
        pools.append(ps)
    tenants, tenant_span = _tenant_stats(ticks, start)
    return Window(
        requested_s=window_s, span_s=end.t - span[0].t, start_wall=span[0].wall,
        end_wall=end.wall, ticks=len(span) - 1, replicas=replicas, pools=pools,
        gateway=_gateway_stats(span), tenants=tenants, tenant_span_s=tenant_span,
        limited=limited_stats(ticks, start),
    )
