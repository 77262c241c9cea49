"""One summary for live and offline replays, computed from per-request records the same way."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Outcome", "against_oracle", "inflight_balance", "percentile", "summarize"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one request (times in the workload's seconds, not wall seconds)."""

    replica: str
    start_s: float
    first_token_s: float | None  # None: failed before a first token
    end_s: float
    ok: bool = True
    seq: int = 0  # arrival order (breaks ties between requests arriving at the same instant)
    error: str = ""  # why it failed, short ("HTTP 401: ...", "connect: ..."); "" when ok


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100.0 * len(ordered))))
    return ordered[rank - 1]


def inflight_balance(
    outcomes: Sequence[Outcome], replicas: Sequence[str], load_factor: float, slack: float
) -> tuple[float, int]:
    """How hot the replica that took each request was, at the moment it took it.

    Returns (the largest load/mean ratio of the chosen replica right after an assignment, over
    assignments at which the fleet-wide mean is at least one request; the number of assignments
    where the chosen replica's load exceeded ``load_factor x mean + slack``, the bounded-load
    rule). Below a mean of one request the ratio says nothing about hot spots.
    """
    events: list[tuple[float, int, int, str]] = []
    for o in outcomes:
        events.append((o.start_s, 1, o.seq, o.replica))
        events.append((o.end_s, 0, o.seq, o.replica))  # ends sort before starts at equal times
    heapq.heapify(events)
    load = dict.fromkeys(replicas, 0)
    total = 0
    worst = 0.0
    violations = 0
    n = max(1, len(replicas))
    while events:
        _, kind, _, replica = heapq.heappop(events)
        delta = 1 if kind == 1 else -1
        load[replica] = load.get(replica, 0) + delta
        total += delta
        if kind == 0:
            continue
        mean = total / n
        if load[replica] > load_factor * mean + slack + 1e-9:
            violations += 1
        if mean >= 1.0:
            worst = max(worst, load[replica] / mean)
    return worst, violations


def summarize(
    *,
    policy: str,
    outcomes: Sequence[Outcome],
    replicas: Sequence[str],
    hit_rate: float | None,
    pooled_reference_hit_rate: float,
    preemptions: int,
    load_factor: float = 1.25,
    load_slack: float = 1.0,
) -> dict[str, object]:
    ttfts = [o.first_token_s - o.start_s for o in outcomes if o.first_token_s is not None]
    e2es = [o.end_s - o.start_s for o in outcomes if o.ok]
    balance, violations = inflight_balance(outcomes, replicas, load_factor, load_slack)
    per_replica = {r: 0 for r in replicas}
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            why = o.error or "failed"
            errors[why] = errors.get(why, 0) + 1
    for o in outcomes:
        per_replica[o.replica] = per_replica.get(o.replica, 0) + 1
    return {
        "policy": policy,
        "requests": len(outcomes),
        "failed": sum(1 for o in outcomes if not o.ok),
        "errors": errors,  # reason -> count of failed requests
        "hit_rate": None if hit_rate is None else round(hit_rate, 4),  # None: not measured
        "pooled_reference_hit_rate": round(pooled_reference_hit_rate, 4),
        "hit_rate_vs_reference": round(hit_rate / pooled_reference_hit_rate, 4)
        if pooled_reference_hit_rate and hit_rate is not None
        else None,
        "ttft_p50_s": round(percentile(ttfts, 50), 4),
        "ttft_p99_s": round(percentile(ttfts, 99), 4),
        "e2e_p50_s": round(percentile(e2es, 50), 4),
        "e2e_p99_s": round(percentile(e2es, 99), 4),
        "max_over_mean_inflight": round(balance, 3),
        "load_bound": {"factor": load_factor, "slack": load_slack, "violations": violations},
        "requests_per_replica": per_replica,
        "preemptions": preemptions,
    }


def against_oracle(summaries: Sequence[dict[str, object]], oracle: str = "oracle") -> None:
    """Add ``hit_rate_vs_oracle`` and ``ttft_p99_vs_oracle`` to every summary of a set that
    includes the oracle's (in place; nothing when it does not)."""
    ref = next((s for s in summaries if s.get("policy") == oracle), None)
    if ref is None:
        return
    hit, p99 = ref["hit_rate"], ref["ttft_p99_s"]
    assert isinstance(hit, float | int) and isinstance(p99, float | int)
    for s in summaries:
        mine_hit, mine_p99 = s["hit_rate"], s["ttft_p99_s"]
        assert isinstance(mine_hit, float | int) and isinstance(mine_p99, float | int)
        s["hit_rate_vs_oracle"] = round(mine_hit / hit, 4) if hit else None
        s["ttft_p99_vs_oracle"] = round(mine_p99 / p99, 4) if p99 else None
