"""One summary for live and offline replays, computed from per-request records the same way."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Outcome", "inflight_balance", "percentile", "summarize"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one request (times in the workload's seconds, not wall seconds)."""

    replica: str
    start_s: float
    first_token_s: float | None  # None: failed before a first token
    end_s: float
    ok: bool = True


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100.0 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def inflight_balance(outcomes: Sequence[Outcome], replicas: Sequence[str]) -> float:
    """The largest max/mean ratio of requests in flight per replica, sampled at every arrival
    at which the fleet-wide mean is at least one request (below that the ratio says nothing
    about hot spots: one request in flight on 8 replicas is 'max/mean = 8')."""
    events: list[tuple[float, int, str]] = []
    for o in outcomes:
        events.append((o.start_s, 1, o.replica))
        events.append((o.end_s, 0, o.replica))  # ends sort before starts at equal times
    heapq.heapify(events)
    load = dict.fromkeys(replicas, 0)
    total = 0
    worst = 0.0
    n = max(1, len(replicas))
    while events:
        _, kind, replica = heapq.heappop(events)
        delta = 1 if kind == 1 else -1
        load[replica] = load.get(replica, 0) + delta
        total += delta
        mean = total / n
        if kind == 1 and mean >= 1.0:
            worst = max(worst, max(load.values()) / mean)
    return worst


def summarize(
    *,
    policy: str,
    outcomes: Sequence[Outcome],
    replicas: Sequence[str],
    hit_rate: float,
    pooled_reference_hit_rate: float,
    preemptions: int,
) -> dict[str, object]:
    ttfts = [o.first_token_s - o.start_s for o in outcomes if o.first_token_s is not None]
    e2es = [o.end_s - o.start_s for o in outcomes if o.ok]
    per_replica = {r: 0 for r in replicas}
    for o in outcomes:
        per_replica[o.replica] = per_replica.get(o.replica, 0) + 1
    return {
        "policy": policy,
        "requests": len(outcomes),
        "failed": sum(1 for o in outcomes if not o.ok),
        "hit_rate": round(hit_rate, 4),
        "pooled_reference_hit_rate": round(pooled_reference_hit_rate, 4),
        "hit_rate_vs_reference": round(hit_rate / pooled_reference_hit_rate, 4)
        if pooled_reference_hit_rate
        else None,
        "ttft_p50_s": round(percentile(ttfts, 50), 4),
        "ttft_p99_s": round(percentile(ttfts, 99), 4),
        "e2e_p50_s": round(percentile(e2es, 50), 4),
        "e2e_p99_s": round(percentile(e2es, 99), 4),
        "max_over_mean_inflight": round(inflight_balance(outcomes, replicas), 3),
        "requests_per_replica": per_replica,
        "preemptions": preemptions,
    }
