"""Offline replay: the routing core and N simulator engines in one process, in simulated time.

No HTTP, no clock: the same `routing.Router` the gateway runs decides, the same `Engine` model
the `kvgate sim` replicas run serves. The gateway's side is reproduced as the gateway does it:
in-flight accounting per replica (requests, and prompt tokens awaiting a first token), scraped
replica gauges refreshed every `scrape_interval_s` (so they are as stale as live), and the
`record_route` / `record_first_token` / `record_failure` calls.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from loadtest.replay.blocks import unit_hashes
from loadtest.replay.summary import Outcome
from loadtest.replay.workload import ReplayRequest
from loadtest.sim.costmodel import get_preset
from loadtest.sim.engine import Engine
from loadtest.sim.spec import EngineConfig, RequestSpec
from routing.features import root_seed
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

__all__ = ["FleetSpec", "OfflineResult", "replay_offline"]

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
    inflight: int = 0
    prefill_tokens: int = 0
    prefill_count: int = 0
    scraped: tuple[float, float, float] = (0.0, 0.0, 0.0)  # waiting, running, kv usage
    scraped_at: float = 0.0


@dataclass(slots=True)
class _Live:
    req: ReplayRequest
    features: RequestFeatures
    replica: _Replica
    seq: int
    first_token_s: float | None = None


@dataclass(slots=True)
class _Sim:
    fleet: FleetSpec
    router: Router
    replicas: list[_Replica]
    live: dict[str, _Live] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)
    deferred: list[tuple[float, int, str, float]] = field(default_factory=list)
    rejected: int = 0


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


def _views(sim: _Sim, now: float) -> list[ReplicaView]:
    out = []
    for r in sim.replicas:
        if now - r.scraped_at >= sim.fleet.scrape_interval_s:
            e = r.engine
            r.scraped = (float(e.num_waiting), float(e.num_running), e.kv_usage)
            r.scraped_at = now
        waiting, running, kv = r.scraped
        out.append(
            ReplicaView(
                id=r.id,
                pool=sim.fleet.pool,
                waiting=waiting,
                running=running,
                kv_usage=kv,
                cache_capacity_tokens=sim.fleet.kv_tokens,
                scrape_age_s=now - r.scraped_at,
                inflight=r.inflight,
                inflight_prefill_tokens=r.prefill_tokens,
                inflight_prefill=r.prefill_count,
            )
        )
    return out


def _advance(sim: _Sim, until: float) -> None:
    """Run every engine up to `until`, feeding first tokens and finishes back at their times.

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
    while sim.deferred and sim.deferred[0][0] <= until:
        _, kind, rid, t = heapq.heappop(sim.deferred)
        live = sim.live[rid]
        if kind == 0:
            _first_token(sim, live, t)
        else:
            _finish(sim, rid, live, t)


def _first_token(sim: _Sim, live: _Live, t: float) -> None:
    r = live.replica
    live.first_token_s = t
    r.prefill_tokens -= live.req.prompt_tokens
    r.prefill_count -= 1
    sim.router.record_first_token(r.id, live.features, t - live.req.arrival_s, t)


def _finish(sim: _Sim, rid: str, live: _Live, t: float) -> None:
    live.replica.inflight -= 1
    del sim.live[rid]
    r, req = live.replica, live.req
    sim.outcomes.append(Outcome(r.id, req.arrival_s, live.first_token_s, t, True, live.seq))


def _route(sim: _Sim, seq: int, req: ReplayRequest) -> None:
    rid = f"r{seq}"
    now = req.arrival_s
    features = _features(req, sim.router)
    decision = sim.router.pick(features, _views(sim, now), now)
    replica = next(r for r in sim.replicas if r.id == decision.replica)
    try:
        replica.engine.add_request(_spec(rid, req, sim.fleet.block_size), now)
    except ValueError:  # longer than max_model_len: vLLM answers 400 before any work
        sim.rejected += 1
        sim.outcomes.append(Outcome(replica.id, now, None, now, False, seq))
        return
    sim.router.record_route(replica.id, features, now)
    replica.inflight += 1
    replica.prefill_tokens += req.prompt_tokens
    replica.prefill_count += 1
    sim.live[rid] = _Live(req, features, replica, seq)


def replay_offline(
    requests: Sequence[ReplayRequest], fleet: FleetSpec, router_config: RouterConfig
) -> OfflineResult:
    """Replay `requests` (sorted by arrival) through `fleet` under `router_config`."""
    cfg = fleet.engine_config()
    replicas = [_Replica(f"replica-{i}", Engine(cfg)) for i in range(fleet.replicas)]
    sim = _Sim(fleet, Router(router_config), replicas)
    order = heapq.nsmallest(len(requests), enumerate(requests), key=lambda ir: ir[1].arrival_s)
    for i, req in order:
        _advance(sim, req.arrival_s)
        _route(sim, i, req)
    _advance(sim, float("inf"))
    stats = [r.engine.stats for r in replicas]
    return OfflineResult(
        outcomes=sim.outcomes,
        replicas=[r.id for r in replicas],
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        preemptions=sum(s.preemptions for s in stats),
        rejected=sim.rejected,
    )
