"""The doctor's rules for one pool: **errors** (a 5xx share), **queue-bound** in flow control's
queue (kvgate holds the requests, the engines show no queue), **routing**: in-flight, waiting
or time-per-request imbalance between replicas (a replica whose engine is slower named as such,
a faster one taking more is fine), an engine hit rate far below the prefix sharing the traffic
allows (against this gateway's own traffic when other gateways feed the same engines), overflow
or spill-over shares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.doctor.findings import (
    MIN_SAMPLES,
    Context,
    Evidence,
    Finding,
    cite,
    fmt_value,
    known,
    median_of,
    not_judged,
    ratio_or_nan,
)
from gateway.doctor.no_sharing import no_hot_prefixes
from gateway.doctor.refusals import refused
from gateway.doctor.replica_rules import replica_down, replica_hung, replica_waiting
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import PoolStats, ReplicaStats

__all__ = ["classify_pool"]

# below this share of a pool's engine traffic, other gateways send the rest: the engines'
# counters are not this gateway's to compare with its own numbers one for one
SHARED_ENGINES = 0.8
SLOW_ITL_TOKENS = 100  # tokens decoded on a replica before its mean decode speed is compared
# requests seen in flight at the ticks (mean in flight x samples) before a replica's in-flight
# count or time per request is compared: with fewer, a burst or a host's hiccup caught by a
# few ticks reads as a spread (a healthy pair, 1.9 s into a light load on a host at load
# average 17: 149 vs 39 ms per request, from ~10 requests seen in flight)
MIN_INFLIGHT_SEEN = 20


def classify_pool(p: PoolStats, th: Thresholds, ctx: Context,
                  window_s: float = math.inf) -> list[Finding]:
    if p.samples < MIN_SAMPLES:
        return [Finding("healthy", "ok", p.name, None,
                        "routing: " + not_judged(p.samples, "samples", ctx, window_s), "none",
                        [])]
    out: list[Finding] = []
    if known(p.flow_queued) and p.requests >= th.min_pool_requests \
            and p.flow_queued >= th.flow_queued_share * p.requests:
        out.append(_flow_queue(p, th, ctx))
    if known(p.flow_shed) and p.requests >= th.min_pool_requests \
            and p.flow_shed >= th.flow_shed_share * p.requests:
        out.append(_flow_shed(p, th, ctx))
    imbalance = _imbalance(p, th, ctx)
    out.extend(imbalance or _routed_around(p, th))
    hit = _hit_gap(p, th, ctx)
    if hit is not None:
        out.append(hit)
    if p.requests >= th.min_pool_requests and p.errors >= th.error_share * p.requests:
        out.append(_errors(p, th))
    if (bad_requests := refused(p, th)) is not None:
        out.append(bad_requests)
    if p.requests >= th.min_pool_requests:
        overflow = p.overflow / p.requests
        if overflow >= th.overflow_share and imbalance:
            # the hot replica's load sends requests away: a symptom, said with the cause
            imbalance[0].evidence.append(cite(
                'kvgate_requests_total{route="overflow"}', "overflow share (a consequence)",
                overflow, ">=", th, "overflow_share", "%"))
        elif overflow >= th.overflow_share:
            out.append(Finding(
                "routing", "warning", p.name, None,
                f"{overflow:.0%} of requests overflowed: the bounded-load rule sent them away "
                "from the replica holding their prefix",
                f"add a replica to pool {p.name} or raise routing.load_factor (now "
                f"{ctx.load_factor:g})",
                [cite('kvgate_requests_total{route="overflow"}', "overflow share", overflow, ">=",
                      th, "overflow_share", "%")]))
        spilled = p.spilled / p.requests
        if spilled >= th.spill_share:
            out.append(Finding(
                "routing", "warning", p.name, None,
                f"{spilled:.0%} of pool {p.name}'s requests spilled to another pool",
                f"add replicas to pool {p.name} (its tier's traffic does not fit)",
                [cite("kvgate_spillovers_total", "spill-over share", spilled, ">=", th,
                      "spill_share", "%")]))
    if not out:
        out.append(_healthy_pool(p, th))
    return out


def _errors(p: PoolStats, th: Thresholds) -> Finding:
    """A pool whose requests end in 5xx: its replicas are down or failing (named on their
    own), or every one is out of rotation."""
    share = p.errors / p.requests
    down = [r.id for r in p.replicas if replica_down(r) is not None]
    listed = [r for r in p.replicas if r.samples >= MIN_SAMPLES and not r.draining]
    if listed and len(down) == len(listed):
        why, action = ("no replica in rotation", f"bring pool {p.name}'s replicas back (each is "
                       "named down: its health checks or requests fail), or add one")
    elif down:
        why, action = (f"{len(down)} of {len(listed)} replicas down",
                       "see the replicas named down; if the others fail too, read kvgate's "
                       "request log for the 5xx reasons (upstream errors, timeouts)")
    else:
        failing = [r.id for r in listed if r.attempts >= th.min_replica_attempts
                   and r.failed >= th.replica_failure_share * r.attempts > 0]
        why, action = ("every replica in rotation", "read kvgate's request log for the 5xx "
                       "reasons (upstream errors, timeouts, cut streams) and the replicas' logs")
        if failing:
            why += f", failing: {', '.join(failing)}"
            action = "see the replicas named with errors; " + action
    return Finding(
        "errors", "critical" if share >= 0.5 else "warning", p.name, None,
        f"{share:.0%} of pool {p.name}'s requests failed (5xx), {why}", action,
        [cite('kvgate_requests_total{status=~"5.."}', "5xx share", share, ">=", th,
              "error_share", "%"),
         cite("kvgate_requests_total", "requests", p.requests),
         cite("kvgate_replica_healthy", "replicas down", float(len(down)))])


def _flow_queue(p: PoolStats, th: Thresholds, ctx: Context) -> Finding:
    """Requests wait in kvgate's flow-control queue: the engines show no queue of their own,
    so the knob is where the pool's bound is reached -- the engines (full: their findings
    say which flag) or flow control's saturation bounds (the engines have room)."""
    share = min(1.0, p.flow_queued / p.requests)
    action, ev = _flow_bound(p, th, ctx)
    ev = [cite("kvgate_flow_queued_total", "requests that waited in flow control's queue",
               share, ">=", th, "flow_queued_share", "%"),
          cite("kvgate_flow_queue_depth", "mean queued", p.flow_depth_mean),
          cite("kvgate_flow_queue_depth / queued per second", "mean wait in the queue",
               p.flow_wait_mean, unit="s"), *ev]
    wait = f", ~{fmt_value(p.flow_wait_mean, 's')} each" if known(p.flow_wait_mean) else ""
    return Finding(
        "queue-bound", "warning", p.name, None,
        f"{share:.0%} of requests waited in kvgate's flow-control queue{wait} (~"
        f"{p.flow_depth_mean:.1f} queued): pool {p.name} is saturated", action, ev)


def _flow_shed(p: PoolStats, th: Thresholds, ctx: Context) -> Finding:
    """Flow control refused requests (its queue full, or their wait past their tier's
    bound): 503s and 429s the clients see, which the pool's 5xx share leaves out."""
    share = min(1.0, p.flow_shed / p.requests)
    action, ev = _flow_bound(p, th, ctx)
    ev = [cite("kvgate_flow_shed_total", "requests shed by flow control", share, ">=", th,
               "flow_shed_share", "%"),
          cite("kvgate_flow_shed_total", "shed", p.flow_shed),
          cite("kvgate_requests_total", "requests", p.requests), *ev]
    return Finding(
        "queue-bound", "critical" if share >= 0.5 else "warning", p.name, None,
        f"{share:.0%} of pool {p.name}'s requests were shed by flow control ({p.flow_shed:.0f} "
        f"of {p.requests:.0f}, answered 503 or 429): pool {p.name} is saturated and its queue "
        "(flow.max_queue, the tiers' max wait) does not hold the excess", action, ev)


def _flow_bound(p: PoolStats, th: Thresholds, ctx: Context) -> tuple[str, list[Evidence]]:
    """Where a pool saturated by flow control reaches its bound -- the engines (full: their
    findings say which flag) or flow control's saturation bounds (the engines have room) --
    as an action, with the replicas' evidence."""
    live = [r for r in p.replicas if r.fresh >= MIN_SAMPLES and not r.draining]
    full = [r.id for r in live if _queueing(r, th) or (known(r.kv_p90) and r.kv_p90 >= th.kv_high)]
    inflight = max((r.inflight_mean for r in live if known(r.inflight_mean)), default=math.nan)
    waiting = max((r.waiting_share for r in live if known(r.waiting_share)), default=math.nan)
    kv = max((r.kv_p90 for r in live if known(r.kv_p90)), default=math.nan)
    # the bound flow control holds the pool to: the policy's for this pool when it sets one
    # (it overrides the configuration's, and raising the configuration's would change nothing)
    bound, knob = ctx.pool_max_inflight(p.name), f"pools.{p.name}.max_inflight in the policy"
    if bound is None:
        bound, knob = ctx.flow_max_inflight, "flow.max_inflight"
    if full:
        action = (f"the engines are full too ({', '.join(full)}: their findings say which "
                  f"flag): act on those, or add replicas to pool {p.name}")
    elif bound and known(inflight) and inflight >= 0.75 * bound:
        action = (f"raise {knob} (now {bound}): the replicas hold "
                  f"~{inflight:.0f} requests each and their engines have room")
    else:
        action = ("the engines have room (no queue of their own, KV below the knee): raise "
                  "the flow control bound the pool reaches (flow.max_unanswered, "
                  "flow.max_prefill_tokens, flow.max_waiting: docs/flow-control.md), or add "
                  "replicas")
    ev = [cite("kvgate_inflight_requests", "mean in flight, busiest replica", inflight),
          cite("vllm:num_requests_waiting", "samples with requests waiting in an engine, most",
               waiting, unit="%"),
          cite("vllm:kv_cache_usage_perc", "KV usage p90, fullest replica", kv, unit="%")]
    return action, ev


# one spread to check: (ReplicaStats attribute, metric, what, least difference, unit)
_Check = tuple[str, str, str, float, str]


def _imbalance(p: PoolStats, th: Thresholds, ctx: Context) -> list[Finding]:
    """The first spread that fires: in flight, time per request, engine waiting; time per
    request rather than in flight when the two name different replicas."""
    # a replica without fresh engine numbers has its own finding (its /metrics); where its
    # requests wait cannot be told, so it is not compared
    live = [r for r in p.replicas if r.samples >= MIN_SAMPLES and not r.draining
            and known(r.healthy_share) and r.healthy_share >= 0.5 and r.fresh >= MIN_SAMPLES
            # a hung engine holds its requests: its own finding
            and not replica_hung(r, th) and not replica_waiting(r, th)]
    if len(live) < 2:
        return []
    checks: tuple[_Check, ...] = (
        ("inflight_mean", "kvgate_inflight_requests", "mean in flight", th.imbalance_min, ""),
        ("time_per_request", "kvgate_inflight_requests / requests per second",
         "time per request", th.slow_min_s, "s"),
        ("waiting_mean", "vllm:num_requests_waiting", "mean waiting", th.imbalance_min, ""),
    )
    started = sum(r.requests for r in live if known(r.requests))
    # Little's law needs this gateway's in flight and its own requests per second; with other
    # gateways sending to the engines (their counts in `requests`), it is not judged
    shared = started > 0 and p.requests < SHARED_ENGINES * started
    found = [(check[0], f) for check in checks
             if not (check[0] == "time_per_request" and shared)
             and (f := _spread(p, th, ctx, live, check)) is not None
             and not (check[0] == "inflight_mean" and not shared
                      and _no_slower(f.replica, live, th))]
    if not found:
        return []
    first, slow = found[0][1], dict(found).get("time_per_request")
    # a load-aware router steers work off a slow replica: the one it lands on has the most in
    # flight, a consequence; the slow one, named by its time per request, is the cause (it was
    # the only replica not named when one of four was 5x slower under cache_aware)
    return [slow if slow is not None and slow.replica != first.replica else first]


def _no_slower(rid: str | None, live: Sequence[ReplicaStats], th: Thresholds) -> bool:
    """The replica holding the most in flight spends no longer per request (Little's law,
    over 4 x ``min_requests``) than its peers' median (those with ``min_requests``): it
    holds more because it is sent more -- a faster engine the router prefers -- and nothing
    waits longer on it. On a CPU-starved host a fast replica beside a 5x slower one held ~4
    in flight (~1 in its engine) and was named 'imbalance', though it answered each request
    in a third of the slow one's time."""
    timed = [r for r in live if r.requests >= th.min_requests and known(r.time_per_request)]
    hot = next((r for r in timed if r.id == rid and r.requests >= 4 * th.min_requests), None)
    peers = [r.time_per_request for r in timed if r is not hot]
    return hot is not None and bool(peers) and hot.time_per_request <= median_of(peers)


def _spread(p: PoolStats, th: Thresholds, ctx: Context, live: Sequence[ReplicaStats],
            check: _Check) -> Finding | None:
    """The replica with the most of one quantity against the median of the others, when
    something waits on it."""
    attr, metric, what, minimum, unit = check
    values = [(getattr(r, attr), r) for r in live if known(getattr(r, attr))
              and (attr != "time_per_request" or r.requests >= 4 * th.min_requests)]
    if attr == "waiting_mean" and values and not _queueing(
            max(values, key=lambda v: v[0])[1], th):
        return None  # the most waiting is requests between two steps, not a queue
    if len(values) < 2:
        return None
    values.sort(key=lambda x: x[0])
    hot_value, hot = values[-1]
    if attr != "waiting_mean" and hot.inflight_mean * hot.samples < MIN_INFLIGHT_SEEN:
        return None
    median = median_of([v for v, _ in values[:-1]])
    floor = 0.5 if unit == "" else 1e-3
    if hot_value < th.imbalance_ratio * max(median, floor) or hot_value - median < minimum:
        return None
    engine = (hot.running_mean if known(hot.running_mean) else 0.0) + (
        hot.waiting_mean if known(hot.waiting_mean) else 0.0)
    # requests held before the engine (its host, network or frontend): at least half of
    # what this gateway has in flight there, and at least `imbalance_min` requests -- a
    # CPU-starved test host or the relay of a stream's last tokens makes a smaller gap
    outside = hot.inflight_mean > 0 and engine < 0.5 * hot.inflight_mean \
        and hot.inflight_mean - engine >= th.imbalance_min
    peers = [r for _, r in values[:-1]]
    itl = _speed(hot, peers, "itl_mean")
    if not outside and known(itl) and itl * th.imbalance_ratio <= 1.0 \
            and not _queueing(hot, th):
        # a replica decoding imbalance_ratio times faster than its peers finishes sooner
        # and takes more (the router weighs speed): nothing waits on it
        return None
    name = "slow_min_s" if unit else "imbalance_min"
    ev = [cite(metric, f"{what} on {hot.id}", hot_value, ">=", th, "imbalance_ratio", unit),
          cite(metric, f"{what}, median of the other replicas", median, unit=unit),
          cite(metric, "difference", hot_value - median, ">=", th, name, unit),
          cite("kvgate_inflight_requests", f"mean in flight on {hot.id}", hot.inflight_mean),
          cite("vllm:num_requests_running", f"engine running + waiting on {hot.id}", engine),
          cite("vllm:time_to_first_token_seconds", f"engine TTFT on {hot.id}",
               hot.ttft_mean, unit="s")]
    ev[0].threshold = th.imbalance_ratio * max(median, floor)
    share = ratio_or_nan(hot.requests, sum(r.requests for r in live if known(r.requests)))
    action = _imbalance_action(hot, peers, attr, outside, engine, ev, th, ctx)
    if action.startswith("lower routing.load_factor") and known(p.potential_hit_rate) \
            and p.potential_hit_rate < th.hit_potential_min:
        action = no_hot_prefixes(hot, peers, p.potential_hit_rate, ev)
    served = f", serving {share:.0%} of the pool's requests" if known(share) else ""
    return Finding(
        "routing", "warning", p.name, hot.id,
        f"imbalance: {what} on {hot.id} {_short(hot_value, unit)} vs a median of "
        f"{_short(median, unit)} on the other replicas{served}", action, ev)


def _routed_around(p: PoolStats, th: Thresholds) -> list[Finding]:
    """A replica whose engine is slower than its peers' (inter-token latency
    ``slow_engine_ratio`` times, TTFT per uncached token ``imbalance_ratio`` times) and that
    a load-aware router therefore sends less than its share: no spread to see (it holds
    less, not more), yet the pool runs on the others' capacity.
    A decode slower by 1.5x under its share (a TTFT slower by 2x under half of it): a 2x
    slower engine sent 19-28 % of a 3-replica pool's requests showed no spread either, its
    measured ratios 1.9-2.1x, and every row said healthy."""
    live = [r for r in p.replicas if r.samples >= MIN_SAMPLES and not r.draining
            and known(r.healthy_share) and r.healthy_share >= 0.5 and r.fresh >= MIN_SAMPLES
            and known(r.requests)]
    started = sum(r.requests for r in live)
    if len(live) < 2 or p.requests < th.min_pool_requests or started <= 0:
        return []
    out = []
    for r in live:
        peers = [x for x in live if x is not r and x.requests >= th.min_requests]
        share = r.requests / started
        if not peers or r.requests <= 0 or share >= _under_share(len(live), started):
            continue
        # TTFT per uncached prompt token: a replica sent the few new prefixes while its
        # peers serve cached ones is not slower for it
        mine = _prefill_per_token(r)
        theirs = [v for x in peers if known(v := _prefill_per_token(x))]
        ttft = ratio_or_nan(mine, median_of(theirs)) if theirs else math.nan
        itl = _speed(r, peers, "itl_mean")
        # the inter-token latency, a mean over many tokens, is judged at slow_engine_ratio;
        # TTFT (a few requests' fixed step times over few uncached tokens) as before
        slow_itl = known(itl) and itl >= th.slow_engine_ratio and r.itl_n >= SLOW_ITL_TOKENS
        slow_ttft = known(ttft) and ttft >= th.imbalance_ratio and share < 0.5 / len(live)
        if not (slow_itl or slow_ttft):
            continue
        slower = max(itl, ttft, key=lambda v: v if known(v) else 0.0)
        ttft_peers = median_of([x.ttft_mean for x in peers if known(x.ttft_mean)] or [math.nan])
        itl_peers = median_of([x.itl_mean for x in peers if known(x.itl_mean)] or [math.nan])
        ev = [cite("vllm:time_to_first_token_seconds", f"engine TTFT per uncached prompt "
                   f"token on {r.id} / its peers' median", ttft, ">=", th, "imbalance_ratio"),
              cite("vllm:inter_token_latency_seconds", f"engine inter-token latency on {r.id} "
                   "/ its peers' median", itl, ">=", th, "slow_engine_ratio"),
              cite("vllm:time_to_first_token_seconds_count",
                   f"share of the pool's started requests on {r.id}", share, unit="%")]
        ev = [e for e in ev if e.value is not None]
        out.append(Finding(
            "routing", "warning", p.name, r.id,
            f"slow engine, routed around: {r.id}'s engine is {slower:.1f}x slower than its "
            f"peers' (TTFT {fmt_value(r.ttft_mean, 's')} vs {fmt_value(ttft_peers, 's')}, "
            f"inter-token latency {fmt_value(r.itl_mean, 's')} vs "
            f"{fmt_value(itl_peers, 's')}); it started {r.requests:,.0f} of the pool's "
            f"{started:,.0f} requests: pool {p.name} runs on the other replicas' capacity",
            "check its GPU, model quantization and engine flags (kvgate already sends it "
            "less)", ev))
    return out


def _under_share(replicas: int, started: float) -> float:
    """The share a replica must be under to have been sent less than its peers: under its
    fair share by a tenth of it or by the spread an even split shows by chance (one binomial
    standard deviation), whichever is more. 29 of 59 requests on one of two replicas (a burst of
    requests at a load's start, a share of 49 %) read as routed around; a 2x slower engine
    sent 19-28 % of a 3-replica pool's hundreds of requests is still under it."""
    fair = 1.0 / replicas
    return fair - max(0.1 * fair, math.sqrt(fair * (1.0 - fair) / started))


def _prefill_per_token(r: ReplicaStats) -> float:
    """Engine seconds to first token per prompt token it did not find in its prefix cache."""
    uncached = r.queries - r.hits
    return ratio_or_nan(r.ttft_mean * r.requests, uncached) if uncached > 0 else math.nan


def _imbalance_action(hot: ReplicaStats, peers: Sequence[ReplicaStats], attr: str,
                      outside: bool, engine: float, ev: list[Evidence], th: Thresholds,
                      ctx: Context) -> str:
    """What to do about the replica taking more: requests held before its engine, an engine
    slower than its peers' (its ratio added to the evidence), or the bounded-load rule."""
    if outside:
        return (f"requests sit before {hot.id}'s engine ({hot.inflight_mean:.1f} in flight, "
                f"{engine:.1f} in the engine): check that replica's host, network or HTTP "
                "frontend, or drain it")
    itl = _speed(hot, peers, "itl_mean")
    slower = max(itl, _speed(hot, peers, "ttft_mean"), key=lambda v: v if known(v) else 0.0)
    if known(slower) and slower >= th.imbalance_ratio:
        ev.append(cite("vllm:inter_token_latency_seconds",
                       f"engine inter-token latency on {hot.id} / its peers' median", itl))
        latency = f"inter-token latency {fmt_value(hot.itl_mean, 's')}"
        return (f"{hot.id}'s engine is {slower:.1f}x slower than its peers' ({latency}, "
                f"TTFT {fmt_value(hot.ttft_mean, 's')}): "
                "check its GPU, model quantization and engine flags"
                + (f", or set routing.policy: cache_aware, which weighs each replica's "
                   f"speed (now {ctx.policy})" if ctx.policy != "cache_aware" else ""))
    if attr == "time_per_request":
        return (f"{hot.id} is slower than its peers: check its GPU and engine flags "
                "(the router already sends it less)")
    return ("lower routing.load_factor so the bounded-load rule spreads hot prefixes "
            "sooner, or add a replica")


def _speed(hot: ReplicaStats, peers: Sequence[ReplicaStats], attr: str) -> float:
    """The hot replica's engine latency (``itl_mean`` or ``ttft_mean``) over its peers'
    median: > 1 slower, < 1 faster; NaN when unknown."""
    theirs = [v for r in peers if known(v := getattr(r, attr))]
    mine = getattr(hot, attr)
    if not theirs or not known(mine):
        return math.nan
    return ratio_or_nan(mine, median_of(theirs))


def _short(v: float, unit: str) -> str:
    return f"{v * 1000:.0f} ms" if unit == "s" else f"{v:.1f}"


def _queueing(r: ReplicaStats, th: Thresholds) -> bool:
    """Requests wait for a seat there, not just for the next step (see queue-bound)."""
    if not (known(r.waiting_share) and r.waiting_share >= th.queue_waiting_share):
        return False
    if known(r.ttft_mean) and known(r.itl_mean) and r.itl_mean > 0:
        return r.ttft_mean >= th.queue_ttft_itl_ratio * r.itl_mean
    return True


def _own_share(p: PoolStats) -> float:
    """This gateway's share of the prompt tokens the pool's engines saw (its answers' usage /
    the engines' prefix-cache queries); NaN when unknown. Well below 1: other gateways (or
    clients) send to the same engines, whose counters then describe their traffic too."""
    queries = sum(r.queries for r in p.replicas)
    if p.prompt_tokens <= 0 or queries <= 0:
        return math.nan
    return min(1.0, p.prompt_tokens / queries)


def _hit_gap(p: PoolStats, th: Thresholds, ctx: Context) -> Finding | None:
    """The whole window's hit rate, else its second half's: a hit rate that collapsed
    mid-window (a cache flushed, a policy change, a new traffic mix) was averaged with the
    half before it and not named."""
    found = _hit_gap_over(p, th, ctx)
    late = p.recent
    if found is not None or late is None or late.samples < MIN_SAMPLES:
        return found
    found = _hit_gap_over(late, th, ctx)
    if found is not None:
        found.summary = f"in the window's last {late.span_s:.0f} s: {found.summary}"
        found.evidence.insert(2, cite("vllm:prefix_cache_hits_total",
                                      "engine hit rate over the whole window",
                                      p.engine_hit_rate, unit="%"))
    return found


def _hit_gap_over(p: PoolStats, th: Thresholds, ctx: Context) -> Finding | None:
    potential, routed, engine = p.potential_hit_rate, p.routed_hit_rate, p.engine_hit_rate
    if p.share_n < 8 or not (known(potential) and known(engine)):
        return None
    own = _own_share(p)
    shared = known(own) and own < SHARED_ENGINES
    if shared:
        # the potential is sampled from this gateway's traffic only: compare it with the best
        # hit rate its traffic can have had, every engine hit counted as its own
        engine = min(1.0, sum(r.hits for r in p.replicas) / p.prompt_tokens)
    if potential < th.hit_potential_min or engine >= th.hit_gap_ratio * potential:
        return None
    what = "engine hit rate (pool)" if not shared else \
        "engine hit rate of this gateway's traffic, at most"
    ev = [cite("kvgate router affinity index (sampled)", "prefix sharing the traffic allows",
               potential, ">=", th, "hit_potential_min", "%"),
          cite("vllm:prefix_cache_hits_total", what, engine, "<", th, "hit_gap_ratio", "%"),
          cite("kvgate router affinity index (sampled)", "expected where the requests were sent",
               routed, unit="%"),
          cite('kvgate_requests_total{route="overflow"}', "overflow share",
               p.overflow / p.requests if p.requests else math.nan, unit="%"),
          cite("kvgate_tenant_tokens_total / vllm:prefix_cache_queries_total",
               "this gateway's share of the engines' prompt tokens", own, unit="%")]
    ev[1].threshold = th.hit_gap_ratio * potential  # the gap rule's bar, in hit-rate terms
    if routed < 0.7 * potential:
        if ctx.policy != "cache_aware":
            action = (f"set routing.policy: cache_aware (now {ctx.policy}): requests are sent "
                      "away from the replica holding their prefix")
        else:
            action = (f"raise routing.load_factor (now {ctx.load_factor:g}) or add a replica: "
                      "load pushes requests away from the replica holding their prefix")
        why = "requests are routed away from their prefix"
    else:
        action = ("give the replicas more KV cache for prefixes (--gpu-memory-utilization, "
                  "fp8 KV) or add a replica: they evict prefixes before they are reused")
        why = "the replicas evict prefixes before reuse"
    return Finding(
        "routing", "warning", p.name, None,
        (f"hit rate at most {engine:.0%} on this gateway's traffic ({own:.0%} of the engines' "
         "prompt tokens; other gateways send the rest)" if shared else f"hit rate {engine:.0%}")
        + f" where the traffic's prefix sharing allows {potential:.0%}: " + why, action, ev)


def _healthy_pool(p: PoolStats, th: Thresholds) -> Finding:
    ev = [cite("kvgate_requests_total", "requests", p.requests),
          cite("kvgate_requests_total", "5xx", p.errors),
          cite("kvgate_request_duration_seconds", "latency p90", p.e2e_p90_client, unit="s"),
          cite("vllm:prefix_cache_hits_total", "engine hit rate", p.engine_hit_rate, unit="%")]
    if p.ttft_n_client:
        ev.insert(3, cite("kvgate_ttft_seconds", "TTFT p90 (streams)", p.ttft_p90_client,
                          unit="s"))
    summary = "routing: nothing above thresholds (" + ", ".join(e.text() for e in ev) + ")"
    if p.requests < th.min_pool_requests:  # shares are not judged: say so, not "nothing"
        summary = (f"routing: {p.requests:.0f} requests in the window, too few to judge (shares "
                   f"are judged from {th.min_pool_requests:.0f}); {p.errors:.0f} failed (5xx)")
    return Finding("healthy", "ok", p.name, None, summary, "none", ev)
