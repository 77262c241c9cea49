"""The doctor's rule for a tenant held back by its own rate limits (class **limits**).

A tenant whose clients send more than its tier (or its own override) allows gets kvgate's 429
(`kvgate_ratelimit_rejections_total`) before any pool sees the request: no pool, replica or
engine number moves, so every row read healthy while the tenant's clients saw most requests
fail. The finding says it is the tenant's configured limit -- kvgate working as configured,
not a fleet fault (severity ``info``) -- and which limit, with the change that lifts it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.doctor.findings import Finding, cite
from gateway.doctor.history import Tick
from gateway.doctor.thresholds import Thresholds

if TYPE_CHECKING:  # window.py reduces the ticks with `limited_stats`: no import cycle
    from gateway.doctor.window import TenantStats

__all__ = ["LimitStats", "limited_stats", "tenant_limits"]

# the admin CLI's flag for each limit label (`kvgate admin tenants update ID --rpm N`)
_FLAGS = {"rpm": "--rpm", "tpm": "--tpm", "concurrency": "--max-concurrency"}
_FIELDS = {"rpm": "rpm", "tpm": "tpm", "concurrency": "max_concurrency"}


@dataclass
class LimitStats:
    tenant: str  # the tenant's metric label (`_other` past tenancy.metrics_max_tenants)
    tier: str
    limit: str  # "rpm", "tpm" or "concurrency"
    rejected: float  # 429s the rate limiter sent in the window


def limited_stats(ticks: Sequence[Tick], start: float) -> list[LimitStats]:
    """The rate limiter's 429s in the window, from the ticks that carry them (the tenant
    ticks): the increase from the last one at or before ``start`` to the last one."""
    marked = [t for t in ticks if t.limited is not None]
    if len(marked) < 2:
        return []
    base = marked[0]
    for t in marked[:-1]:
        if t.t <= start:
            base = t
    before = {k[:3]: k[3] for k in base.limited or ()}
    out = []
    for tier, tenant, limit, now in marked[-1].limited or ():
        then = before.get((tier, tenant, limit), 0.0)
        rise = now - then if now >= then else now  # a counter that went back starts over
        if rise > 0:
            out.append(LimitStats(tenant, tier, limit, rise))
    return out


def tenant_limits(limited: Sequence[LimitStats], tenants: Sequence[TenantStats],
                  th: Thresholds) -> list[Finding]:
    """An ``info`` finding per tenant that got at least ``limited_share`` of its requests (of
    at least ``min_pool_requests``, answered or refused) refused by its own limits."""
    by_tenant: dict[str, list[LimitStats]] = {}
    for s in limited:
        by_tenant.setdefault(s.tenant, []).append(s)
    out = []
    for tenant, rows in sorted(by_tenant.items()):
        rejected = sum(r.rejected for r in rows)
        served = sum(t.requests for t in tenants if t.tenant == tenant)
        total = rejected + served
        if total < th.min_pool_requests or rejected < th.limited_share * total:
            continue
        out.append(_finding(tenant, rows, rejected, served, th))
    return out


def _finding(tenant: str, rows: list[LimitStats], rejected: float, served: float,
             th: Thresholds) -> Finding:
    share = rejected / (rejected + served)
    top = max(rows, key=lambda r: r.rejected)
    limits = ", ".join(sorted({r.limit for r in rows}))
    tiers = ", ".join(sorted({r.tier for r in rows}))
    flag, field = _FLAGS.get(top.limit, f"--{top.limit}"), _FIELDS.get(top.limit, top.limit)
    who = ("the tenants past tenancy.metrics_max_tenants (label _other)" if tenant == "_other"
           else f"tenant {tenant}")
    name = "ID" if tenant == "_other" else tenant
    return Finding(
        "limits", "info", None, None,
        f"{who}: {share:.0%} of its requests were refused 429 by its own rate limit "
        f"({limits}, tier {tiers}): kvgate's configured limits, not a fault of the fleet",
        f"if it should get more, raise its {top.limit} (kvgate admin tenants update {name} "
        f"{flag} N, or tier {top.tier}'s limits.{field}); otherwise its clients must send less "
        "(each 429 carries Retry-After)",
        [cite("kvgate_ratelimit_rejections_total", "share refused by the tenant's limits",
              share, ">=", th, "limited_share", "%"),
         cite("kvgate_ratelimit_rejections_total", "requests refused (429)", rejected),
         cite("kvgate_tenant_tokens_total", "requests answered", served)])
