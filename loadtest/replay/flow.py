"""Flow control in the offline replay: the gateway's admission queue, in simulated time.

`FlowDriver` puts `routing.flow.PoolFlow` -- the code the live gateway runs -- in front of
each simulated gateway's router: an arriving request goes straight to `offline._route` while
the pool has room and nothing is queued, otherwise it waits in the queue and is routed when
the rule lets it out. While anything is queued the replay advances one pump tick at a time
(`_step_until`, the live gateway's ``flow.tick_ms``), so a request is released within a tick
of the first token, finish or fresh scrape that frees room, as the live pump releases it; a
request past its tier's longest wait, or displaced from a full queue, is shed (an `Outcome`
that failed, kept apart from the routed ones so the routing summary is unchanged).

Every request sent is the pool's until it finishes (`finished`): the share cap
(`routing.flow.share`) counts what each tenant holds, as the live gateway does.

`tier_summaries` adds what the flow-control benchmarks read: per tier and per tenant TTFT
p50/p99, sheds, goodput (share of *all* the tier's requests, shed ones included, whose first
token came within the TTFT SLO), served tokens; `flow_report` adds the fair-share ratios
(`loadtest.replay.fairshare`) and their Jain index.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gateway.policy_doc import PolicyDoc, TierConfig, TierFlow
from loadtest.replay import offline
from loadtest.replay.fairshare import FairShareMeter
from loadtest.replay.summary import Outcome, percentile
from loadtest.replay.workload import ReplayRequest
from routing.flow import FlowConfig, PoolFlow, Saturation, request_cost
from routing.peers import ReplicaLoad
from routing.types import ReplicaView

__all__ = [
    "FlowDriver",
    "FlowSpec",
    "default_policy",
    "flow_report",
    "flow_spec",
    "jain",
    "pool_rule",
    "tier_summaries",
]

_NO_PEERS: Mapping[str, ReplicaLoad] = {}


def default_policy() -> PolicyDoc:
    """The replay's tiers: premium before free (bands from their priorities), equal weights."""
    return PolicyDoc(tiers={
        "default": TierConfig(),
        "premium": TierConfig(priority=0, flow=TierFlow(max_wait_s=10.0)),
        "free": TierConfig(priority=1),
    })


@dataclass(frozen=True, slots=True)
class FlowSpec:
    config: FlowConfig = field(default_factory=FlowConfig)
    policy: PolicyDoc = field(default_factory=default_policy)
    tick_s: float = 0.005  # the pump period while requests wait (the gateway's flow.tick_ms)
    room_only: bool = True  # route only to replicas with room (the gateway's flow.room_only)
    fair_window_s: float = 10.0  # the fair-share yardstick's window (loadtest.replay.fairshare)


@dataclass(slots=True)
class _Held:
    seq: int
    req: ReplayRequest


class FlowDriver:
    """Flow control for `offline.replay_offline` (its ``flow`` argument)."""

    def __init__(self, spec: FlowSpec) -> None:
        self.spec = spec
        self._flows: dict[str, PoolFlow[_Held]] = {}  # gateway id -> its pool's flow
        self.shed: list[Outcome] = []
        self.shed_reasons: dict[str, int] = {}
        self.queued = 0  # requests that waited in a queue
        self.arrivals: dict[int, float] = {}  # seq -> arrival (queued requests only)
        self.max_depth = 0
        self._last = 0.0  # the last pump
        self.fair = FairShareMeter(spec.fair_window_s)

    def _flow(self, gw: offline._Gateway, pool: str = "") -> PoolFlow[_Held]:
        flow = self._flows.get(gw.id)
        if flow is None:
            fair = self.spec.policy.fairness
            flow = self._flows[gw.id] = PoolFlow(self.spec.config, fair.min_share,
                                                 fair.default_min_share)
            flow.set_saturation(pool_rule(self.spec, pool))
        return flow

    # -- the replay's hooks -----------------------------------------------------------------
    def arrive(
        self, sim: offline._Sim, seq: int, req: ReplayRequest, gw: offline._Gateway
    ) -> None:
        now = req.arrival_s
        self._step_until(sim, now)
        flow = self._flow(gw, sim.fleet.pool)
        cost = _cost(req)
        views, peers = offline._views(sim, gw, now), _peers(gw, now)
        band, weight, max_wait = self.spec.policy.flow_class(req.tier, req.tenant)
        if flow.admit(views, cost, now, peers, req.tenant, weight):
            self._send(sim, flow, seq, req, gw, views, peers)
            return
        offer = flow.offer(_Held(seq, req), tenant=req.tenant, band=band, cost=cost, now=now,
                           max_wait_s=max_wait, weight=weight, tier=req.tier)
        for gone in offer.evicted:
            self.fair.dropped((gw.id, gone.band), gone.tenant, gone.cost)
            self._shed(gone.handle, now, "queue_full")
        if offer.entry is None:
            self._shed(_Held(seq, req), now, "queue_full")
            return
        self.fair.queued((gw.id, band), req.tenant, cost, weight, now)
        self.queued += 1
        self.arrivals[seq] = now
        self.max_depth = max(self.max_depth, len(flow.queue))
        self._pump(sim, now)

    def finished(self, req: ReplayRequest, gw: offline._Gateway) -> None:
        self._flow(gw).done(req.tenant, _cost(req))

    def _send(
        self, sim: offline._Sim, flow: PoolFlow[_Held], seq: int, req: ReplayRequest,
        gw: offline._Gateway, views: list[ReplicaView], peers: Mapping[str, ReplicaLoad],
    ) -> None:
        """Route a request the flow let through (the pool holds it until it finishes)."""
        if not offline._route(sim, seq, req, gw, self._narrow(flow, views, peers, req)):
            flow.done(req.tenant, _cost(req))  # refused at once: it holds nothing

    def drain(self, sim: offline._Sim) -> None:
        """After the last arrival: run until every queue is empty; fix the routed outcomes'
        start times (a queued request's TTFT counts from its arrival, not its release)."""
        self._step_until(sim, math.inf)
        arrivals = self.arrivals
        sim.outcomes[:] = [replace(o, start_s=arrivals[o.seq]) if o.seq in arrivals else o
                           for o in sim.outcomes]

    # -- time -------------------------------------------------------------------------------
    def _step_until(self, sim: offline._Sim, until: float) -> None:
        """Advance to ``until``; while anything is queued, one pump tick at a time (as the
        live gateway pumps), releasing and shedding at each tick."""
        tick = self.spec.tick_s
        while any(self._flows.values()):
            t = self._next_tick(sim, tick)
            if t >= until:
                break
            offline._advance(sim, t)
            self._pump(sim, t)
        if until != math.inf:
            offline._advance(sim, until)

    def _next_tick(self, sim: offline._Sim, tick: float) -> float:
        """The next pump: one tick after the last one, or later when nothing can change
        before then (every engine idle, no event due): the next event or deadline."""
        t = self._last + tick
        if any(r.engine.busy for r in sim.replicas):
            return t
        nxt = math.inf
        if sim.deferred:
            nxt = sim.deferred[0][0]
        if sim.transit:
            nxt = min(nxt, sim.transit[0][0])
        for flow in self._flows.values():
            deadline = flow.queue.next_deadline()
            if deadline is not None:
                nxt = min(nxt, deadline)
        # nothing runs: at the latest the next scrape shows the idle pool
        return max(t, min(nxt, self._last + sim.fleet.scrape_interval_s))

    def _pump(self, sim: offline._Sim, now: float) -> None:
        self._last = now
        for gw in sim.gateways:
            flow = self._flows.get(gw.id)
            if not flow:
                continue
            for entry in flow.expire(now):
                self.fair.dropped((gw.id, entry.band), entry.tenant, entry.cost)
                self._shed(entry.handle, now, "max_wait")
            while flow.queue:
                views, peers = offline._views(sim, gw, now), _peers(gw, now)
                out = flow.release(views, now, peers)
                if out is None:
                    break
                self.fair.released((gw.id, out.band), out.tenant, out.cost, now)
                held = out.handle
                self._send(sim, flow, held.seq, replace(held.req, arrival_s=now), gw, views,
                           peers)

    def _narrow(
        self, flow: PoolFlow[_Held], views: list[ReplicaView],
        peers: Mapping[str, ReplicaLoad], req: ReplayRequest,
    ) -> list[ReplicaView] | None:
        if not self.spec.room_only:
            return None
        return flow.with_room(views, peers, req.prompt_tokens, req.tenant, _cost(req),
                              req.arrival_s)

    def _shed(self, held: _Held, now: float, reason: str) -> None:
        self.shed.append(Outcome("none", held.req.arrival_s, None, now, False, held.seq,
                                 f"shed: {reason}"))
        self.shed_reasons[reason] = self.shed_reasons.get(reason, 0) + 1


def pool_rule(spec: FlowSpec, pool: str) -> Saturation:
    """``pool``'s saturation rule as the gateway takes it (`gateway.flow.gate`): the config's,
    with the policy's in-flight bound for the pool (``pools.<p>.max_inflight``) when it sets
    one. The replay took the config's alone: a policy bounding a pool at a few requests in
    flight replayed as if unbounded."""
    rule = spec.config.saturation
    cfg = spec.policy.pools.get(pool)
    if cfg is None or cfg.max_inflight is None:
        return rule
    return replace(rule, max_inflight=cfg.max_inflight)


def flow_spec(max_inflight: int | None) -> FlowSpec:
    """The replay's flow control, its pools bounded at ``max_inflight`` requests in flight
    per replica (``--flow-max-inflight``; None: no such bound)."""
    if max_inflight is None:
        return FlowSpec()
    sat = replace(FlowConfig().saturation, max_inflight=max_inflight)
    return FlowSpec(config=FlowConfig(saturation=sat))


def _cost(req: ReplayRequest) -> float:
    return request_cost(req.prompt_tokens, req.output_tokens, 0)


def _peers(gw: offline._Gateway, now: float) -> Mapping[str, ReplicaLoad]:
    peers = gw.router.peers
    return peers.totals(now) if peers is not None else _NO_PEERS


# -- summaries ------------------------------------------------------------------------------
def jain(values: Iterable[float]) -> float:
    """Jain's fairness index: 1.0 when all equal, 1/n when one takes everything."""
    xs = list(values)
    total = sum(xs)
    squares = sum(x * x for x in xs)
    return round(total * total / (len(xs) * squares), 4) if xs and squares else 1.0


def _group(
    reqs: Sequence[ReplayRequest], outcomes: Iterable[Outcome], key: str, slo_s: float
) -> dict[str, dict[str, object]]:
    by: dict[str, list[Outcome]] = {}
    count: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for r in reqs:
        name = getattr(r, key)
        count[name] = count.get(name, 0) + 1
    for o in outcomes:
        r = reqs[o.seq]
        name = getattr(r, key)
        by.setdefault(name, []).append(o)
        if o.ok:
            tokens[name] = tokens.get(name, 0) + r.prompt_tokens + r.output_tokens
    out: dict[str, dict[str, object]] = {}
    for name in sorted(count):
        group = by.get(name, [])
        ttfts = [o.first_token_s - o.start_s for o in group if o.first_token_s is not None]
        good = sum(1 for t in ttfts if t <= slo_s)
        out[name] = {
            "requests": count[name],
            "ttft_p50_s": round(percentile(ttfts, 50), 4),
            "ttft_p99_s": round(percentile(ttfts, 99), 4),
            "shed": sum(1 for o in group if o.error.startswith("shed")),
            "goodput": round(good / count[name], 4) if count[name] else 0.0,
            "served_tokens": tokens.get(name, 0),
        }
    return out


def tier_summaries(
    reqs: Sequence[ReplayRequest], outcomes: Iterable[Outcome], slo_s: float
) -> dict[str, object]:
    """``tiers`` and ``tenants``: {name: {ttft_p50_s, ttft_p99_s, shed, goodput, ...}}."""
    done = list(outcomes)
    return {
        "slo_ttft_s": slo_s,
        "tiers": _group(reqs, done, "tier", slo_s),
        "tenants": _group(reqs, done, "tenant", slo_s),
    }


def flow_report(
    reqs: Sequence[ReplayRequest], routed: Sequence[Outcome], driver: FlowDriver | None,
    slo_s: float,
) -> dict[str, object]:
    """What `kvgate replay --offline` adds to a summary: flow control's counts, the per-tier
    and per-tenant view, and the fair-share view (per tenant: tokens released from the queue
    over its max-min share of them while it waited, `loadtest.replay.fairshare`; 1.0 is
    exactly fair)."""
    shed = driver.shed if driver is not None else []
    out: dict[str, object] = {
        "flow_control": driver is not None,
        "shed": len(shed),
        **tier_summaries(reqs, [*routed, *shed], slo_s),
    }
    if driver is not None:
        ratios = driver.fair.ratios()
        out["flow"] = {
            "queued": driver.queued, "max_depth": driver.max_depth,
            "shed_reasons": dict(driver.shed_reasons),
            "fair_share": ratios,
            "fair_windows": driver.fair.windows,
            "jain": jain(ratios.values()) if ratios else None,
        }
    return out
