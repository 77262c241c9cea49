"""Offline replay: the routing core and N simulator engines in one process, in simulated time.

No HTTP, no clock: the same `routing.Router` the gateway runs decides, the same `Engine` model
the `kvgate sim` replicas run serves. The gateway's side is reproduced as the gateway does it:
in-flight accounting per replica (requests, and prompt tokens awaiting a first token), scraped
replica gauges refreshed every `scrape_interval_s` (so they are as stale as live), and the
`record_route` / `record_first_token` / `record_failure` calls.

Several gateways (`GatewaySpec`): each request goes to one of N routers at random (seeded);
each router keeps its own in-flight counts and scrapes, and, when they share state, sees the
others' records (`Router.apply_peer_routes` / `apply_peer_load`, the calls the live gateway
makes for records read from Redis) ``sync_delay_s`` later. ``share=False`` is N gateways that
know nothing of each other. Peers never crash here, so none ages out.

Besides the registry's policies, ``router_config.policy`` may name a yardstick: a peer's
published rule (`routing.policies.YARDSTICKS`) or ``oracle`` (`loadtest.replay.oracle`, which
reads the engines' true state; before each pick it is told the request's engine blocks).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from typing import Protocol

from loadtest.replay.blocks import unit_hashes
from loadtest.replay.oracle import Oracle, Truth
from loadtest.replay.summary import Outcome
from loadtest.replay.workload import ReplayRequest
from loadtest.sim.costmodel import get_preset
from loadtest.sim.engine import Engine
from loadtest.sim.spec import EngineConfig, RequestSpec
from routing.features import root_seed
from routing.learning import EngineCounters
from routing.load import still_running
from routing.peers import ReplicaLoad, RouteRecord
from routing.policies import YARDSTICKS, PolicyFactory
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

__all__ = ["FleetSpec", "FlowHook", "GatewaySpec", "OfflineResult", "replay_offline"]

MODEL = "replay-model"


@dataclass(frozen=True, slots=True)
class FleetSpec:
    replicas: int = 8
    kv_tokens: int = 262_144  # per replica
    profile: str = "h100-8b-fp8"  # a simulator preset (cost model)
    block_size: int = 16
    max_model_len: int = 131_072
    scrape_interval_s: float = 0.25
    pool: str = "pool"

    def engine_config(self) -> EngineConfig:
        preset = get_preset(self.profile)
        return EngineConfig(
            cost=preset.cost,
            num_gpu_blocks=self.kv_tokens // self.block_size,
            block_size=self.block_size,
            max_model_len=min(self.max_model_len, self.kv_tokens - self.block_size),
        )


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    gateways: int = 1
    share: bool = True  # exchange routing records (else N independent gateways)
    sync_delay_s: float = 0.0  # a record reaches the other gateways this much later
    seed: int = 0  # which gateway takes which request
    # a pick at risk of stacking with peers' unseen picks is held rank x sync delay
    # (`Router.defer_s`; TTFT still counts from the arrival)
    defer: bool = True


@dataclass(slots=True)
class OfflineResult:
    outcomes: list[Outcome]
    replicas: list[str]
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    rejected: int = 0

    @property
    def hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclass(slots=True)
class _Replica:
    id: str
    engine: Engine


@dataclass(slots=True)
class _Counts:
    """One gateway's own accounting of one replica."""

    inflight: int = 0
    prefill_tokens: int = 0
    prefill_count: int = 0
    scraped: tuple[float, float, float] = (0.0, 0.0, 0.0)  # waiting, running, kv usage
    scraped_at: float = 0.0
    scrapes: int = 0
    ended_since_scrape: int = 0  # in flight at the last scrape, ended since (as the gateway's)


@dataclass(slots=True)
class _Gateway:
    id: str
    router: Router
    counts: dict[str, _Counts]

    def load(self, replica: str) -> ReplicaLoad:
        c = self.counts[replica]
        return ReplicaLoad(
            c.inflight, c.prefill_count, c.prefill_tokens, self.router.own_load(replica)
        )


@dataclass(slots=True)
class _Live:
    req: ReplayRequest
    features: RequestFeatures
    replica: _Replica
    gateway: _Gateway
    seq: int
    scrapes: int  # its gateway's scrapes of its replica before it was sent
    first_token_s: float | None = None


class FlowHook(Protocol):
    """Flow control's side of the replay (`loadtest.replay.flow.FlowDriver`)."""

    def arrive(self, sim: _Sim, seq: int, req: ReplayRequest, gw: _Gateway) -> None: ...
    def finished(self, req: ReplayRequest, gw: _Gateway) -> None: ...
    def drain(self, sim: _Sim) -> None: ...


# a record in transit: (delivery time, order, target gateway, sender, routes, loads)
_Delivery = tuple[float, int, int, str, list[RouteRecord], dict[str, ReplicaLoad]]


@dataclass(slots=True)
class _Sim:
    fleet: FleetSpec
    spec: GatewaySpec
    gateways: list[_Gateway]
    replicas: list[_Replica]
    live: dict[str, _Live] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    deferred: list[tuple[float, int, str, float]] = field(default_factory=list)
    transit: list[_Delivery] = field(default_factory=list)
    sent: int = 0
    rejected: int = 0
    truth: Truth | None = None  # the oracle's view of the engines
    flow: FlowHook | None = None  # told when a request finishes


def _features(req: ReplayRequest, router: Router) -> RequestFeatures:
    cfg = router.config
    tpb = cfg.tokens_per_block
    n = min(req.prompt_tokens // tpb, cfg.max_blocks)
    seed = root_seed(MODEL, req.tenant)
    hashes = unit_hashes(req.block_ids, req.block_tokens, tpb, n, seed)
    return RequestFeatures(
        model=MODEL,
        block_hashes=hashes,
        prompt_tokens=req.prompt_tokens,
        tenant=req.tenant,
        stream=True,
        prefix_key=hash((req.block_ids, req.prompt_tokens)) & (2**63 - 1),
    )


def _spec(rid: str, req: ReplayRequest, block_size: int) -> RequestSpec:
    seed = root_seed("engine", req.tenant)
    n = req.prompt_tokens // block_size
    hashes = unit_hashes(req.block_ids, req.block_tokens, block_size, n, seed)
    return RequestSpec(
        request_id=rid,
        block_hashes=hashes,
        prompt_tokens=req.prompt_tokens,
        max_tokens=req.output_tokens,
        ignore_eos=True,
    )


def _views(sim: _Sim, gw: _Gateway, now: float) -> list[ReplicaView]:
    out = []
    for r in sim.replicas:
        c = gw.counts[r.id]
        if now - c.scraped_at >= sim.fleet.scrape_interval_s:
            e = r.engine
            c.scraped = (float(e.num_waiting), float(e.num_running), e.kv_usage)
            c.scraped_at = now
            c.scrapes += 1
            c.ended_since_scrape = 0
            st = e.stats  # the prefill histograms' sums and count, as the gateway scrapes them
            gw.router.record_counters(r.id, EngineCounters(
                st.prefill_seconds, st.prefill_requests, st.prefill_computed_tokens,
                float(e.num_waiting)), now)
        waiting, running, kv = c.scraped
        out.append(
            ReplicaView(
                id=r.id,
                pool=sim.fleet.pool,
                waiting=waiting,
                running=still_running(running, c.ended_since_scrape),
                kv_usage=kv,
                cache_capacity_tokens=sim.fleet.kv_tokens,
                scrape_age_s=now - c.scraped_at,
                inflight=c.inflight,
                inflight_prefill_tokens=c.prefill_tokens,
                inflight_prefill=c.prefill_count,
            )
        )
    return out


def _publish(sim: _Sim, gw: _Gateway, replica: str, now: float) -> None:
    """``gw``'s load on ``replica`` changed (and it may have routed): tell the others."""
    routes = gw.router.drain_outbox()
    if not sim.spec.share or len(sim.gateways) == 1:
        return
    loads = {replica: gw.load(replica)}
    at = now + sim.spec.sync_delay_s
    for i, other in enumerate(sim.gateways):
        if other is not gw:
            sim.sent += 1
            heapq.heappush(sim.transit, (at, sim.sent, i, gw.id, routes, loads))


def _deliver(sim: _Sim, d: _Delivery) -> None:
    at, _, target, sender, routes, loads = d
    router = sim.gateways[target].router
    router.apply_peer_routes(routes, sender, at)
    router.apply_peer_load(sender, loads, at)


def _advance(sim: _Sim, until: float) -> None:
    """Run every engine up to `until`, feeding first tokens, finishes and other gateways'
    records back at their times.

    An engine runs each step that starts before `until`, so some outputs carry later times:
    they wait in `sim.deferred` until simulated time reaches them, as the gateway would only
    see them then.
    """
    for r in sim.replicas:
        for out in r.engine.advance(until):
            if out.request_id in sim.live:
                first = out.first_token_time
                if first is not None:
                    heapq.heappush(sim.deferred, (first, 0, out.request_id, first))
                if out.finish_reason is not None:
                    heapq.heappush(sim.deferred, (out.time, 1, out.request_id, out.time))
    deferred, transit = sim.deferred, sim.transit
    while deferred or transit:
        t_event = deferred[0][0] if deferred else float("inf")
        t_sync = transit[0][0] if transit else float("inf")
        if min(t_event, t_sync) > until:
            return
        if t_sync <= t_event:
            _deliver(sim, heapq.heappop(transit))
            continue
        _, kind, rid, t = heapq.heappop(deferred)
        live = sim.live[rid]
        if kind == 0:
            _first_token(sim, live, t)
        else:
            _finish(sim, rid, live, t)


def _first_token(sim: _Sim, live: _Live, t: float) -> None:
    gw, r = live.gateway, live.replica
    c = gw.counts[r.id]
    live.first_token_s = t
    c.prefill_tokens -= live.req.prompt_tokens
    c.prefill_count -= 1
    gw.router.record_first_token(r.id, live.features, t - live.req.arrival_s, t)
    _publish(sim, gw, r.id, t)


def _finish(sim: _Sim, rid: str, live: _Live, t: float) -> None:
    gw, r, req = live.gateway, live.replica, live.req
    c = gw.counts[r.id]
    c.inflight -= 1
    if live.scrapes < c.scrapes:
        c.ended_since_scrape += 1
    del sim.live[rid]
    sim.outcomes.append(Outcome(r.id, req.arrival_s, live.first_token_s, t, True, live.seq))
    if sim.flow is not None:
        sim.flow.finished(req, gw)
    _publish(sim, gw, r.id, t)


def _route(
    sim: _Sim, seq: int, req: ReplayRequest, gw: _Gateway,
    views: list[ReplicaView] | None = None, held: bool = False,
) -> bool:
    """Route `req` now (`views`: the replicas to pick from, when the caller narrowed them).
    False: the replica refused it at once (longer than its context)."""
    rid = f"r{seq}"
    now = req.arrival_s
    features = _features(req, gw.router)
    spec = _spec(rid, req, sim.fleet.block_size)
    if sim.truth is not None:
        sim.truth.request = spec
    decision = gw.router.pick(features, views if views is not None else _views(sim, gw, now), now,
                              held=held)
    replica = next(r for r in sim.replicas if r.id == decision.replica)
    try:
        replica.engine.add_request(spec, now)
    except ValueError:  # longer than max_model_len: vLLM answers 400 before any work
        sim.rejected += 1
        # the reason, as a live replay reports a 400's message ("failed" said nothing)
        limit = replica.engine.config.max_model_len
        why = f"HTTP 400: prompt + output over max_model_len {limit}"
        sim.outcomes.append(Outcome(replica.id, now, None, now, False, seq, why))
        return False
    gw.router.record_route(replica.id, features, now)
    c = gw.counts[replica.id]
    c.inflight += 1
    c.prefill_tokens += req.prompt_tokens
    c.prefill_count += 1
    sim.live[rid] = _Live(req, features, replica, gw, seq, c.scrapes)
    _publish(sim, gw, replica.id, now)
    return True


def _release(
    sim: _Sim, held: list[tuple[float, int, ReplayRequest, int]], until: float
) -> None:
    """Route the held requests due by ``until``, each at its time."""
    while held and held[0][0] <= until:
        at, seq, req, g = heapq.heappop(held)
        _advance(sim, at)
        _route(sim, seq, dc_replace(req, arrival_s=at), sim.gateways[g], held=True)


def _yardstick(name: str, truth: Truth | None) -> PolicyFactory | None:
    """The factory of a policy outside the registry (None: the registry's ``name``)."""
    if truth is not None:
        return lambda state: Oracle(state, truth)
    return YARDSTICKS.get(name)


def replay_offline(
    requests: Sequence[ReplayRequest],
    fleet: FleetSpec,
    router_config: RouterConfig,
    gateways: GatewaySpec | None = None,
    progress: Callable[[int], None] | None = None,
    flow: FlowHook | None = None,
) -> OfflineResult:
    """Replay `requests` (sorted by arrival) through `fleet` under `router_config`.

    `progress`, when given, is called with 1 after each request is routed (e.g.
    `loadtest.replay.report.Progress.step`). `flow`: flow control in front of the routers
    (`loadtest.replay.flow.FlowDriver`): it takes each arrival and routes it now or later."""
    spec = gateways or GatewaySpec()
    cfg = fleet.engine_config()
    replicas = [_Replica(f"replica-{i}", Engine(cfg)) for i in range(fleet.replicas)]
    truth = Truth({r.id: r.engine for r in replicas}) if router_config.policy == "oracle" else None
    factory = _yardstick(router_config.policy, truth)
    # picks are held (`Router.defer_s`) only here: flow control routes on its own schedule
    defers = spec.defer and spec.share and spec.gateways > 1 and flow is None
    gws = []
    for g in range(max(1, spec.gateways)):
        router = Router(router_config, policy=factory)
        if spec.share and spec.gateways > 1:
            # no peer crashes offline; records arrive sync_delay_s late
            router.enable_sharing(float("inf"), f"gw-{g}", spec.sync_delay_s, defers)
        gws.append(_Gateway(f"gw-{g}", router, {r.id: _Counts() for r in replicas}))
    sim = _Sim(fleet, spec, gws, replicas, truth=truth, flow=flow)
    pick_gateway = random.Random(spec.seed).randrange
    order = heapq.nsmallest(len(requests), enumerate(requests), key=lambda ir: ir[1].arrival_s)
    held: list[tuple[float, int, ReplayRequest, int]] = []  # (route at, seq, req, gateway)
    arrivals: dict[int, float] = {}  # seq -> arrival (held requests only)
    for i, req in order:
        gw = gws[pick_gateway(len(gws))] if len(gws) > 1 else gws[0]
        if flow is not None:  # flow control (loadtest/replay/flow.py)
            flow.arrive(sim, i, req, gw)
        else:
            _release(sim, held, req.arrival_s)
            _advance(sim, req.arrival_s)
            views, wait = None, 0.0
            if defers:
                views = _views(sim, gw, req.arrival_s)
                wait = gw.router.defer_s(_features(req, gw.router), views, req.arrival_s)
            if wait > 0.0:
                arrivals[i] = req.arrival_s
                heapq.heappush(held, (req.arrival_s + wait, i, req, gws.index(gw)))
            else:
                _route(sim, i, req, gw, views)
        if progress is not None:
            progress(1)
    _release(sim, held, float("inf"))
    if flow is not None:
        flow.drain(sim)
    _advance(sim, float("inf"))
    if arrivals:  # a held request's TTFT counts from its arrival, not its pick
        sim.outcomes[:] = [dc_replace(o, start_s=arrivals[o.seq]) if o.seq in arrivals else o
                           for o in sim.outcomes]
    stats = [r.engine.stats for r in replicas]
    return OfflineResult(
        outcomes=sim.outcomes,
        replicas=[r.id for r in replicas],
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        preemptions=sum(s.preemptions for s in stats),
        rejected=sim.rejected,
    )
