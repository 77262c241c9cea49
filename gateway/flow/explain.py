"""Flow control as the admin API shows it (`gateway/admin/live.py`): a pool's queue for
`GET /admin/replicas`, and for `POST /admin/route/explain` whether a request would queue,
what it would wait behind and where its tenant stands against the share cap. It reads
`FlowGate`'s state and applies the rules `FlowGate.admit` does; nothing is queued or changed.
"""

from __future__ import annotations

from typing import Any

from gateway.body import ParsedBody
from gateway.flow.gate import FlowGate
from gateway.planner import Plan
from gateway.pool import Pool
from gateway.tenancy.resolver import Principal
from routing.flow import replica_reasons

__all__ = ["flow_explain", "pool_state"]


def pool_state(gate: FlowGate, pool: Pool, now: float) -> dict[str, Any]:
    """For `GET /admin/replicas`: the pool's queue and whether it is saturated."""
    state = gate.pools().get(pool.name)
    return {"saturated": gate.saturated(pool, now),
            "queued": len(state.flow.queue) if state is not None else 0,
            "bands": {str(b): n for b, n in state.flow.queue.depth().items()}
            if state is not None else {}}


def flow_explain(
    gate: FlowGate, principal: Principal, plan: Plan, parsed: ParsedBody, kind: str, now: float
) -> tuple[dict[str, Any], Plan]:
    """Would this request queue, and what would it wait behind (nothing is queued); where
    its tenant stands against the share cap (`PoolFlow.standing`). With the plan dispatch
    would pick from: where it would wait, `FlowGate.admit` first tries the tier's spill-over."""
    info = _standing(gate, principal, plan, parsed, now)
    if info["would_queue"]:
        alt = gate.spill(kind, principal, parsed, plan, now)
        if alt is not None:
            return {**info, "would_queue": False, "spills_to": alt.pool.name}, alt
    return info, plan


def _standing(
    gate: FlowGate, principal: Principal, plan: Plan, parsed: ParsedBody, now: float
) -> dict[str, Any]:
    band, weight, max_wait = gate.doc(principal).flow_class(principal.tier, principal.tenant_id)
    state = gate.state(plan.pool.name)
    peers = gate.peers(now)
    # as admit sees them: a replica backing off after a busy 503 is full, not gone (read
    # as gone, a pool of busy replicas was "not saturated" while its requests queued)
    views = gate.busy_full(plan.pool.name, plan.views, now)
    saturated = state.flow.saturated(views, peers)
    queued = len(state.flow.queue)
    # with other gateways live a band below the top one waits for room to last two lags
    held = gate.held_band(state, views, peers, gate.doc(principal), now)
    lower_held = held is not None and band > held
    cost = gate.cost_of(plan, parsed)
    share = state.flow.standing(principal.tenant_id, views, cost, now, peers)
    no_spare = share.spare == ()  # a hog with no replica of spare room waits for one
    est = state.flow.queue.wait_estimate(band, now) if saturated or queued else 0.0
    if no_spare and not (saturated or queued):
        est = None  # it waits for spare room, not behind the queue
    return {
        "enabled": True, "pool": plan.pool.name, "saturated": saturated,
        "would_queue": saturated or queued > 0 or no_spare or lower_held, "queued": queued,
        "band": band, "weight": weight, "max_wait_s": max_wait, "cost_tokens": cost,
        "ahead_tokens": state.flow.queue.ahead(band),
        "inflight_share": round(share.inflight_share, 4),
        "recent_share": round(share.recent_share, 4),
        "fair_share": round(share.fair_share, 4) if share.fair_share is not None else None,
        "share_cap": gate.core.share_cap,
        "over_share": share.over_share, "hog": share.hog,
        "spare_replicas": list(share.spare) if share.spare is not None else None,
        "waits_for_spare": no_spare,
        "estimated_wait_s": round(est, 3) if est is not None else None,
        "replicas": replica_reasons(views, state.flow.config.saturation, peers),
    }
