"""The gateway's long-lived parts, started in order on one `AsyncExitStack`.

`start_runtime` builds and starts tenancy, the pools (following the policy in force), discovery,
health polling, the drain reaper, the scraper, shared routing state, the doctor and the admin
API. Each part pushes its own stop onto the stack as soon as it has started, so a start that
fails half way stops exactly what had started, in reverse order; shutdown is `stack.aclose()`.
The result is one frozen `Runtime`: the app's dispatch and pages read it, nothing reassigns it.

`Membership` (`gateway/membership.py`) follows which replicas exist: a policy version or a
discovery source re-lists pools; leavers drain, then are forgotten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway import worker_metrics
from gateway.admin import AdminDeps, admin_tokens_from_env, create_admin_app
from gateway.admin.auth import admin_authorized, admin_body_limit
from gateway.admin.guard import AuthGuard, AuthGuardCollector
from gateway.admin.live import LiveViews
from gateway.admin.writes import read_your_writes
from gateway.asgi import ASGIApp
from gateway.config import KvgateConfig, auth_secret
from gateway.config.selfloop import running_ports
from gateway.doctor import build_doctor
from gateway.doctor.flowq import flow_queues
from gateway.doctor.service import Doctor
from gateway.errors import ConfigError
from gateway.fleet.metrics import SyncCollector
from gateway.fleet.settings import SyncSettings
from gateway.fleet.sync import RouteSync
from gateway.flow import FlowGate, PeerLag
from gateway.health import HealthMonitor
from gateway.jsondepth import guard_json_depth
from gateway.membership import Membership
from gateway.metrics import GatewayMetrics
from gateway.policy_doc import DEFAULT_TIER
from gateway.pool import Pools
from gateway.proxy import Proxy
from gateway.replicas import Lost, Replica
from gateway.responses import SharedHomes
from gateway.scrape import Sample, Scraper
from gateway.tenancy import Tenancy, Tenant, build_tenancy, connect_redis
from gateway.tenancy.edge import NO_AUTH_TENANT, TenantGate, TenantLabels
from gateway.tenancy.fallback import FallbackRateLimiter
from gateway.tenancy.fleet_seen import FleetSeen
from gateway.tenancy.holders import holder_note
from gateway.tenancy.last_state import LastState
from gateway.tenancy.service import TenancyCollector
from gateway.transport import TransportFactory, default_transport
from routing.peers import ReplicaLoad
from routing.router import Router

__all__ = ["Runtime", "start_runtime"]

log = logging.getLogger(__name__)
# the log line of a replica whose prefix cache is empty, by why (`Replica.record_scrape`): a
# replica found gone was logged "restarted" while nothing listened at its address yet
_LOST: dict[Lost, str] = {
    "restarted": "replica restarted: its prefix cache starts empty",
    "gone": "replica gone (nothing listens at its address): its prefix cache is lost",
    "asleep": "replica's engine put to sleep: its prefix cache is discarded",
}


@dataclass(frozen=True, slots=True)
class Runtime:
    """Everything a started gateway serves with."""

    tenancy: Tenancy
    gate: TenantGate
    pools: Pools
    proxy: Proxy
    scraper: Scraper
    sync: RouteSync | None  # shared routing state (with Redis)
    doctor: Doctor  # `kvgate doctor`'s rolling history
    admin: ASGIApp  # the admin API, mounted at /admin


async def start_runtime(
    cfg: KvgateConfig, router: Router, metrics: GatewayMetrics, clock: Callable[[], float],
    stack: AsyncExitStack, transport: TransportFactory = default_transport,
) -> Runtime:
    """Start every part in order, each registering its stop on ``stack`` once started.
    ``transport`` makes each pool's upstream client (tests pass an in-process one)."""
    tenancy, gate = await _start_tenancy(cfg, metrics, stack)
    snap = tenancy.resolver.policy  # the store's policy, once seeded from config
    pools = Pools(cfg, snap.doc if snap is not None else cfg.policy_doc(), transport)
    stack.push_async_callback(pools.close)
    by_id = {r.id: r for r in pools.replicas()}  # replica id -> replica; scrapes land here
    scraper = _scraper(cfg, by_id, router, clock, stack)
    sync = _route_sync(cfg, router, pools, by_id, clock)
    if sync is not None and isinstance(tenancy.limiter, FallbackRateLimiter):
        peers = router.peers
        if peers is not None:  # a Redis outage divides limits by the fleet it last saw
            tenancy.limiter.processes = lambda: 1 + peers.members(clock())
            if (slot := worker_metrics.current()) is not None:  # and a worker started in one
                tenancy.limiter.kept = FleetSeen(slot.directory, slot.slot)
    members = Membership(pools, by_id, router, scraper, sync, metrics, clock,
                         linger_s=cfg.upstream.total_timeout_s)
    stack.push_async_callback(members.stop)
    # subscribed before the next await, so no policy version can slip in between
    stack.callback(tenancy.resolver.on_policy(members.policy_changed))
    proxy = Proxy(cfg, pools, router, metrics, clock, gate)
    if tenancy.redis_url is not None:  # Responses API ids relayed by other gateways
        shared = proxy.responses.shared = SharedHomes(
            connect_redis(tenancy.redis_url, max_connections=16), tenancy.settings.namespace)
        stack.push_async_callback(shared.close)
    if cfg.flow.enabled:  # flow control: an admission queue per pool (gateway/flow/)
        lag = PeerLag(sync, cfg.flow.peer_lag_ms) if sync is not None else None
        flow = proxy.prep.flow = FlowGate(cfg.flow, pools, router, proxy.planner, metrics,
                                          clock, lag)
        # after `members`: the pools follow a new policy before the queues move to them
        stack.callback(tenancy.resolver.on_policy(flow.policy_changed))
    await members.start_discovery()
    monitor = HealthMonitor(pools, cfg.health, clock,
                            quiet_s=cfg.routing.scrape_timeout_ms / 1000.0)
    await monitor.poll_once()  # know who is up (and the served names) before serving
    _run(stack, monitor.run(), "kvgate-health")
    _run(stack, members.reap_drained(), "kvgate-drain")
    await scraper.start()
    stack.push_async_callback(scraper.stop)
    if sync is not None:
        await sync.start()  # logs where it connects, then "on" or why Redis does not answer
        stack.push_async_callback(sync.stop)
    metrics.registry.register(SyncCollector(router, sync, clock))
    doctor = build_doctor(
        cfg, router, metrics, pools.described, scraper.errors, redis_up=gate.redis_up,
        sync_degraded=lambda: sync.degraded if sync else None,
        redis_cause=gate.redis_down_cause,
        sync_cause=lambda: sync.down_cause if sync else None,
        tenancy_loaded=lambda: tenancy.resolver.health().loaded, clock=clock,
        flow=flow_queues(proxy.prep.flow) if proxy.prep.flow is not None else None,
        no_load_data=scraper.no_load_data, pool_max_inflight=lambda name: (
            None if (pc := pools.doc.pools.get(name)) is None else pc.max_inflight))
    proxy.prep.sharing = doctor.sharing
    await doctor.start()
    stack.push_async_callback(doctor.stop)
    _share_metrics(metrics, stack)
    admin = _admin_app(cfg, tenancy, gate, pools, router, proxy, scraper, doctor, metrics, clock,
                       sync)
    stack.callback(members.close)  # the first thing shutdown does: stop following changes
    return Runtime(tenancy, gate, pools, proxy, scraper, sync, doctor, admin)


async def _start_tenancy(
    cfg: KvgateConfig, metrics: GatewayMetrics, stack: AsyncExitStack
) -> tuple[Tenancy, TenantGate]:
    tcfg = cfg.tenancy
    secret, salted = auth_secret(cfg)
    redis_url = cfg.redis_url.get_secret_value() if cfg.redis_url else None
    tenancy = build_tenancy(tcfg, secret, redis_url, workers=cfg.server.workers, salted=salted)
    tenants = [Tenant(id=t.id, tier=t.tier, salt_group=t.salt_group) for t in cfg.tenants]
    if not tcfg.auth:  # the 'default' tier: models' default pools, no limits unless set
        tenants.append(Tenant(id=NO_AUTH_TENANT, tier=DEFAULT_TIER))
    stack.push_async_callback(tenancy.close)
    slot = worker_metrics.current()
    if slot is not None and tenancy.redis_url is not None:  # for a worker restarted meanwhile
        tenancy.resolver.last_state = LastState(slot.directory, slot.slot)
    if slot is not None and tenancy.lease_holder is not None:  # freed by the supervisor
        holder_note(slot.directory, slot.slot).write(tenancy.lease_holder)
    await tenancy.start(tenants=tenants, policy=cfg.policy_doc())
    labels = TenantLabels(tcfg.metrics_tenants, tcfg.metrics_max_tenants)
    gate = TenantGate(tenancy, auth=tcfg.auth, salted=salted, client_salt=tcfg.client_salt,
                      labels=labels)
    metrics.watch_tenancy(lambda: (gate.redis_up(), tenancy.resolver.health().policy_version),
                          gate.redis_down_cause)
    metrics.registry.register(TenancyCollector(tenancy.resolver))
    return tenancy, gate


def _scraper(
    cfg: KvgateConfig, by_id: dict[str, Replica], router: Router, clock: Callable[[], float],
    stack: AsyncExitStack,
) -> Scraper:
    """Polls every replica's vLLM /metrics; samples land on the replica (`record_scrape`) and
    the engine's prefill counters teach the router's TTFT model (`record_counters`)."""
    # aiohttp: a scrape costs a quarter of httpx's CPU (measured: ~540 vs ~2,260 µs per page)
    client = aiohttp.ClientSession()
    stack.push_async_callback(client.close)

    def on_sample(replica_id: str, sample: Sample | None, now: float) -> None:
        replica = by_id.get(replica_id)
        if replica is not None:
            lost = replica.record_scrape(sample, now)
            if sample is None and scraper.answered(replica_id):
                # a page without vllm:* (--disable-log-stats) is a sign of life too: without
                # it, one late /health read such a replica as frozen (`Replica.frozen`)
                replica.replies += 1
            if lost is not None:  # its prefix cache is empty: what the router knew is gone
                log.info(_LOST[lost], extra={"pool": replica.pool, "replica": replica_id})
                router.forget_cache(replica_id)
            counters = sample.engine_counters() if sample is not None else None
            if counters is not None:  # every request teaches the TTFT model
                router.record_counters(replica_id, counters, now)

    interval = cfg.routing.scrape_interval_ms / 1000.0
    # one scrape may take longer than the interval (a busy vLLM serves /metrics late): each
    # replica is polled by its own task, one scrape at a time, the view stale meanwhile
    # (`routing.stale_after_s`: the router falls back to kvgate's own accounting)
    scraper = Scraper(client, on_sample, interval_s=interval,
                      timeout_s=cfg.routing.scrape_timeout_ms / 1000.0, clock=clock)
    for replica in by_id.values():
        scraper.add_target(replica.id, replica.url)
    return scraper


def _route_sync(
    cfg: KvgateConfig, router: Router, pools: Pools, by_id: dict[str, Replica],
    clock: Callable[[], float],
) -> RouteSync | None:
    """Shared routing state with the other gateway processes (Redis only; not started)."""
    sc = cfg.sync
    url = cfg.redis_url.get_secret_value() if cfg.redis_url else None
    if not (url and sc.enabled):
        return None
    settings = SyncSettings(
        flush_interval_s=sc.flush_interval_ms / 1000.0, heartbeat_s=sc.heartbeat_s,
        stale_after_s=sc.stale_after_s, stream_maxlen=sc.stream_maxlen,
        stream_max_mb=sc.stream_max_mb,
        catchup_entries=sc.catchup_entries, max_entries_per_tick=sc.max_entries_per_tick,
        timeout_s=sc.timeout_s,
        defer=sc.hold_picks and not cfg.flow.enabled,  # flow control picks on its own
        hold_window_s=sc.hold_window_ms / 1000.0,
    )

    def own_loads() -> dict[str, ReplicaLoad]:
        """This process's own load per replica (published to the other gateways)."""
        pending = router.own_load
        return {
            r.id: ReplicaLoad(r.inflight, r.inflight_prefill, r.inflight_prefill_tokens,
                              pending(r.id) if r.inflight else 0.0)
            for r in pools.described()
        }

    sync = RouteSync(router, url, cfg.tenancy.namespace, settings, own_loads,
                     by_id.__contains__, clock)
    for replica in pools.described():
        replica.watch = sync.wake
    return sync


def _admin_app(
    cfg: KvgateConfig, tenancy: Tenancy, gate: TenantGate, pools: Pools, router: Router,
    proxy: Proxy, scraper: Scraper, doctor: Doctor, metrics: GatewayMetrics,
    clock: Callable[[], float], sync: RouteSync | None,
) -> ASGIApp:
    token = cfg.admin_token.get_secret_value() if cfg.admin_token else None
    try:
        tokens = admin_tokens_from_env(token)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    live = LiveViews(pools, router, proxy.prep, gate, scraper, clock)
    live.flow = proxy.prep.flow
    live.sync = sync
    resolver = tenancy.resolver
    deps = AdminDeps(tenancy.store, tokens, replicas=live.replicas, explain=live.explain,
                     doctor=doctor.report,
                     policy_in_force=lambda: (resolver.policy, resolver.policy_source),
                     guard=AuthGuard.share_of(cfg.server.workers),
                     listen_host=cfg.server.host, own_ports=running_ports(cfg))
    metrics.registry.register(AuthGuardCollector(deps.guard))
    admin = read_your_writes(create_admin_app(
        deps, openapi_url="/admin/openapi.json", docs_url="/admin/docs"),
        tenancy.resolver.refresh)  # a write is in force here when it is answered
    # throttled: 429 before the body is read; no valid admin token: the app's 401/403, the
    # body unread; too large: 413, too deep: 400, before the admin app reads the body
    app: ASGIApp = guard_json_depth(
        admin, max_bytes=admin_body_limit(cfg.server.max_body_bytes),
        admit=deps.guard.check_scope, authorized=admin_authorized(tokens))
    return app


def _share_metrics(metrics: GatewayMetrics, stack: AsyncExitStack) -> None:
    """A worker of several (`server.workers`): /metrics answers with every worker's series."""
    slot = worker_metrics.current()
    if slot is None:
        metrics.registry.register(worker_metrics.NoRestarts())
        return
    exposition = worker_metrics.WorkerExposition(
        slot, metrics.render_own, metrics.render_state)
    metrics.render_all = exposition.render
    stack.callback(exposition.remove)
    _run(stack, exposition.run(), "kvgate-worker-metrics")


def _run(stack: AsyncExitStack, work: Coroutine[Any, Any, None], name: str) -> None:
    """A background task, cancelled and awaited when the stack closes."""
    task = asyncio.create_task(work, name=name)

    async def stop() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    stack.push_async_callback(stop)
