"""The triage as pure functions: a window's numbers and the threshold table in, findings out,
worst first. The rules live by what they judge: `replica_rules` (down, errors, scrapes, the
engine classes: KV-, decode-, prefill-, queue-bound), `pool_rules` (errors, flow control's
queue, routing) and `process_rules` (the gateway process); `findings` holds what they produce.
Anything with no finding is reported **healthy**, with the numbers that say so. Every evidence
item names its metric and threshold.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.doctor.findings import CLASSES, SEVERITIES, Context, Finding
from gateway.doctor.pool_rules import classify_pool
from gateway.doctor.process_rules import classify_gateway
from gateway.doctor.replica_rules import classify_replica
from gateway.doctor.tenant_limits import tenant_limits
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import Window

__all__ = ["classify", "sort_findings"]

_ORDER = {s: i for i, s in enumerate(SEVERITIES)}
_CLASS_ORDER = {c: i for i, c in enumerate(CLASSES)}


def classify(w: Window, th: Thresholds, ctx: Context) -> list[Finding]:
    """Every finding of the window, worst first."""
    out: list[Finding] = []
    out.extend(classify_gateway(w.gateway, th, ctx))
    out.extend(tenant_limits(w.limited, w.tenants, th))
    for pool in w.pools:
        found = classify_pool(pool, th, ctx, w.requested_s)
        out.extend(found)
        # a replica the pool's routing findings already name (an imbalance, a slow engine
        # routed around) is not named a slow engine a second time, nor healthy: a 4x slower
        # replica was listed "healthy: nothing above thresholds" (or "idle", the router
        # sending it little) beside the warning naming it
        named = {f.replica for f in found if f.cls == "routing"}
        alone = len(pool.replicas) == 1
        for r in pool.replicas:
            peers = [x for x in pool.replicas if x is not r]
            out.extend(f for f in classify_replica(r, th, ctx, w.requested_s, alone, peers)
                       if not (f.cls in ("routing", "healthy") and f.replica in named))
    return sort_findings(out)


def sort_findings(findings: Sequence[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (
        _ORDER.get(f.severity, 9), _CLASS_ORDER.get(f.cls, 9), f.pool or "", f.replica or ""))
