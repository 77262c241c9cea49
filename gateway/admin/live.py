"""The running gateway as the admin API sees it: `GET /admin/replicas`, `POST /admin/route/explain`.

`LiveViews` reads the gateway's own state (pools, replica counters, last scrapes) and plans a
request exactly as the proxy would (`Preparer.parse` -- a long prompt in the proxy's worker
threads --, `Planner`, flow control's spill-over, then `Router.pick(..., explain=True)`),
without sending it and without recording anything in the router. Salts never appear in the
output.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from gateway.errors import BadRequest, NotFound, shown_name
from gateway.fleet.sync import RouteSync
from gateway.flow import FlowGate, flow_explain, pool_state
from gateway.policy_doc import Limits
from gateway.pool import Pools
from gateway.prepare import Preparer
from gateway.replicas import Replica
from gateway.scrape import Scraper
from gateway.tenancy.edge import TenantGate
from gateway.tenancy.resolver import Principal
from gateway.urls import shown_url
from gateway.wideints import wide_int_error
from routing.peers import ZERO, ReplicaLoad
from routing.router import NoCandidate, Router

__all__ = ["ENDPOINTS", "LiveViews"]

ENDPOINTS = {"chat": "chat", "completions": "completions", "embeddings": "embeddings",
             "responses": "responses"}


class LiveViews:
    def __init__(
        self, pools: Pools, router: Router, prep: Preparer, gate: TenantGate,
        scraper: Scraper | None, clock: Callable[[], float],
    ) -> None:
        self._pools, self._router, self._planner = pools, router, prep.planner
        self._parse = prep.parse
        self._gate, self._scraper, self._clock = gate, scraper, clock
        self.flow: FlowGate | None = None  # flow control, when on (gateway/flow/)
        self.sync: RouteSync | None = None  # shared routing state, when on (gateway/fleet/)

    # -- GET /admin/replicas -----------------------------------------------------------------
    def replicas(self) -> dict[str, Any]:
        now = self._clock()
        snap = self._gate.tenancy.resolver.policy
        peers = self._router.peers.totals(now) if self._router.peers is not None else {}
        data = []
        for pool in self._pools.by_name.values():
            prio = self._pools.doc.pools.get(pool.name)
            entry: dict[str, Any] = {
                "pool": pool.name, "served_model": pool.served_model,
                "priority": bool(prio and prio.priority),
                "replicas": [self._replica(r, now, peers) for r in pool.replicas],
                # left the pool (policy, discovery), requests still in flight: an operator
                # scaling down waits for this to empty before stopping the process
                "draining": [self._replica(r, now, peers) for r in self._pools.draining
                             if r.pool == pool.name],
            }
            if self.flow is not None:  # flow control's queue for this pool
                entry["flow"] = pool_state(self.flow, pool, now)
            data.append(entry)
        # a pool the policy removed, its replicas' last requests still in flight: listed
        # until they end (a scale-down's whole pool is what an operator waits on)
        for name in sorted({r.pool for r in self._pools.draining} - self._pools.by_name.keys()):
            data.append({"pool": name, "removed": True, "served_model": None, "priority": False,
                         "replicas": [], "draining": [self._replica(r, now, peers)
                                                      for r in self._pools.draining
                                                      if r.pool == name]})
        out: dict[str, Any] = {
            "object": "list", "policy_version": snap.version if snap else 0, "data": data,
            "sync": self._sync(now)}
        return out

    def _sync(self, now: float) -> dict[str, Any]:
        """The shared routing state's health, where an operator looks at the replicas (it
        showed only the member and the peers: a sharing that never came up, a Redis refusing
        its writes, a reader far behind looked the same as a healthy one)."""
        sync, peers = self.sync, self._router.peers
        if sync is None or peers is None:
            return {"enabled": False}
        st = sync.stats
        lags = sorted(st.recent_lags)
        return {
            "enabled": True, "member": self._router.member, "degraded": sync.degraded,
            "cause": None if st.up else sync.reach.cause,  # (its explanation: an ACL, ...)
            "peers": peers.members(now), "published": st.published, "applied": st.applied,
            # peers' batches: written to Redis -> applied here (Redis's clock), the recent ones
            "apply_lag_s": {"samples": len(lags), "p50": _rank(lags, 0.5),
                            "p99": _rank(lags, 0.99), "max": _rank(lags, 1.0)},
        }

    def _replica(
        self, r: Replica, now: float, peers: Mapping[str, ReplicaLoad]
    ) -> dict[str, Any]:
        s = r.scraped
        p = peers.get(r.id, ZERO)
        fit = self._router.ttft_fit(r.id)
        return {
            "id": r.id, "url": shown_url(r.url), "healthy": r.available(now), "state": r.state,
            # why it was last found down (its health checks: "/health answered 503", "serves
            # model 'm-b', not the pool's 'm-a'"); None while it answers
            "reason": r.reason,
            # own: this gateway process's; fleet: own + every live peer's (shared state)
            "inflight": r.inflight, "inflight_prefill": r.inflight_prefill,
            "inflight_fleet": r.inflight + p.inflight,
            "inflight_prefill_fleet": r.inflight_prefill + p.prefill,
            "waiting": s.waiting if s else None, "running": s.running if s else None,
            "kv_usage": s.kv_usage if s else None,
            "cache_capacity_tokens": s.cache_capacity_tokens if s else None,
            "scrape_age_s": round(now - r.scraped_at, 3) if s else None,
            "scrape_errors": self._scraper.errors(r.id) if self._scraper else 0,
            # the router's learned TTFT model: fixed part + prompt tokens / prefill rate
            "prefill_tps": round(fit.rate, 1), "ttft_fixed_s": round(fit.fixed_s, 4),
        }

    # -- POST /admin/route/explain -------------------------------------------------------------
    async def explain(self, body: dict[str, Any]) -> dict[str, Any]:
        """``{"tenant": id | "tier": name, "endpoint": "chat", "request": {...}}`` -> plan."""
        principal = self._principal(body)
        endpoint = body.get("endpoint", "chat")
        kind = ENDPOINTS.get(endpoint) if isinstance(endpoint, str) else None
        if kind is None:
            raise BadRequest(f"endpoint: one of {', '.join(ENDPOINTS)}", param="endpoint")
        request = body.get("request")
        if not isinstance(request, dict):
            raise BadRequest("request: the OpenAI request body (an object)", param="request")
        try:
            raw = orjson.dumps(request)
        except TypeError:  # the admin API's parser keeps integers orjson cannot write
            raise wide_int_error() from None
        parsed = await self._parse(raw, kind, principal)  # a long prompt: off the event loop
        now = self._clock()
        plan = self._planner.plan(principal, parsed, kind, now)
        # would it wait in flow control's queue (and behind how much)? where it would, the
        # tier's spill-over is tried first: the plan the pick is made from
        flow: dict[str, Any] = {"enabled": False, "would_queue": False}
        if self.flow is not None:
            flow, plan = flow_explain(self.flow, principal, plan, parsed, kind, now)
        # several gateways: would the pick be held for the lower ranks' (`Router.defer_s`)?
        # then it is explained as it would be made, without a turn
        held_s = 0.0
        try:
            if self.flow is None and self._router.defers:
                held_s = self._router.defer_s(plan.features, plan.views, now)
            decision = self._router.pick(plan.features, plan.views, now, explain=True,
                                         held=held_s > 0.0)
        except NoCandidate:
            decision = None
        snap = principal.policy
        return {
            "tenant": principal.tenant_id, "tier": principal.tier,
            "policy_version": snap.version if snap else 0,
            "pool": plan.pool.name, "home_pool": plan.home,
            "tier_route": "spill" if plan.spilled else "tier",
            "served_model": plan.served, "priority": plan.priority,
            "prompt_tokens": plan.features.prompt_tokens,
            "prefix_blocks": len(plan.features.block_hashes),
            "replica": decision.replica if decision else None,
            "reason": ("spill" if plan.spilled else decision.reason) if decision else "none",
            "router_reason": decision.reason if decision else "no healthy replica",
            "fallbacks": list(decision.fallbacks) if decision else [],
            "candidates": [
                {"replica": c.replica, "cost": c.cost, "terms": c.terms}
                for c in (decision.ranked if decision else ())
            ],
            "flow": flow,
            "held_ms": round(held_s * 1000.0, 3),
        }

    def _principal(self, body: dict[str, Any]) -> Principal:
        resolver = self._gate.tenancy.resolver
        tenant, tier = body.get("tenant"), body.get("tier")
        for name, value in (("tenant", tenant), ("tier", tier)):
            if value is not None and not (isinstance(value, str) and value):
                raise BadRequest(f"{name}: a non-empty string", param=name)
        if tenant is not None:
            try:
                return resolver.principal_for(tenant)
            except NotFound as exc:  # the resolver's error names no field: this one is sent
                raise NotFound(exc.message, param="tenant") from None
        if tier is None:
            raise BadRequest("tenant or tier: one of them is required", param="tenant")
        snap = resolver.policy
        if snap is not None and not snap.doc.knows_tier(tier):  # (as tenants' tiers)
            raise BadRequest(f"tier: unknown tier {shown_name(tier)!r}", param="tier")
        # a tier alone has no tenant salt: prefix affinity is shown for an unsalted prompt
        return Principal(tenant_id="(explain)", tier=tier, limits=Limits(), salt_group=None,
                         cache_salt="", policy=snap)


def _rank(ordered: list[float], q: float) -> float | None:
    """The `q` quantile of sorted values (nearest rank), rounded to the millisecond's tenth."""
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)
