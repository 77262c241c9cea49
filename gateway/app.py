"""The gateway as one plain ASGI application.

Proxied routes skip any framework: a dict lookup on the path, then `Proxy.handle`. The app's
lifespan owns everything long-lived (tenancy: store, resolver sync, limiter; pools and their
transports, discovery sources, the health poller, the scraper, the drain reaper) and creates
it at start-up, cancels and awaits it at shutdown. Pools follow the policy document in force
(a new version adds, removes or re-lists pools on every gateway replica); pools with
`discovery` follow their source. A replica that leaves drains: no new picks, its in-flight
requests finish, then the scraper and the router forget it. The admin API (FastAPI) is
mounted at ``/admin``.
vLLM's operator endpoints (`/sleep`, `/reset_prefix_cache`, `/collective_rpc`, ...) are not
routes here, so they are never reachable through kvgate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import orjson

from gateway import __version__
from gateway.admin import AdminDeps, admin_tokens_from_env, create_admin_app
from gateway.admin.guard import AuthGuardCollector
from gateway.admin.live import LiveViews
from gateway.asgi import Receive, Scope, Send
from gateway.config import KvgateConfig, auth_secret
from gateway.discovery import DiscoveryConfigError, DiscoveryManager, build_discovery
from gateway.doctor import build_doctor
from gateway.doctor.service import Doctor
from gateway.errors import ConfigError, KvgateError, NotFound
from gateway.fleet.metrics import SyncCollector
from gateway.fleet.sync import RouteSync, SyncSettings
from gateway.health import HealthMonitor
from gateway.jsondepth import guard_json_depth
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.policy import DEFAULT_TIER
from gateway.pool import PoolChanges, Pools
from gateway.proxy import KINDS, Proxy
from gateway.replicas import Replica
from gateway.scrape import Sample, Scraper
from gateway.stored import match_stored
from gateway.tenancy import PolicySnapshot, Tenancy, TenancySettings, Tenant, build_tenancy
from gateway.tenancy.edge import NO_AUTH_TENANT, TenantGate, TenantLabels
from gateway.tenancy.service import TenancyCollector
from routing.peers import ReplicaLoad
from routing.router import Router

__all__ = ["GatewayApp"]

log = logging.getLogger(__name__)
Headers = list[tuple[bytes, bytes]]
Page = tuple[int, Headers, bytes]
JSON: Headers = [(b"content-type", b"application/json")]
DISCOVERY_FIRST_SYNC_S = 5.0  # start-up waits this long for discovered replicas, at most
REAP_INTERVAL_S = 0.25  # how often draining replicas are checked for their last request


class MethodNotAllowed(KvgateError):
    status = 405
    type_ = "MethodNotAllowedError"


class GatewayApp:
    def __init__(
        self,
        cfg: KvgateConfig,
        clock: Callable[[], float] = time.monotonic,
        after_start: Callable[[GatewayApp], Awaitable[None]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.after_start = after_start  # e.g. `kvgate demo` creating its tenants' keys
        self.router = Router(cfg.routing.router_config())
        self.metrics = GatewayMetrics(
            self._described, clock, scrape_errors=self._scrape_errors,
            affinity=self.router.affinity_entries,
        )
        self.pools: Pools | None = None
        self.discovery = DiscoveryManager(build_discovery, self._discovered)
        self.proxy: Proxy | None = None
        self.scraper: Scraper | None = None
        self.sync: RouteSync | None = None  # shared routing state (with Redis)
        self.tenancy: Tenancy | None = None
        self.gate: TenantGate | None = None
        self.doctor: Doctor | None = None  # `kvgate doctor`'s rolling history
        self._by_id: dict[str, Replica] = {}  # replica id -> replica (scrape samples land here)
        self._unsubscribe: Callable[[], None] = lambda: None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()  # one-off (discovery re-sync)
        self._mounts: list[tuple[str, Callable[..., object]]] = []
        self._get = {
            "/healthz": self._healthz, "/readyz": self._readyz,
            "/metrics": self._metrics_page, "/v1/models": self._models,
            # vLLM's operational paths, for drop-in use (benchmark clients probe /health)
            "/health": self._healthz, "/ping": self._healthz, "/version": _version_page,
        }

    def mount(self, prefix: str, app: Callable[..., object]) -> None:
        """Route `prefix/...` to another ASGI app (e.g. the FastAPI admin API)."""
        self._mounts.append((prefix.rstrip("/"), app))

    def _described(self) -> Iterator[Replica]:
        return self.pools.described() if self.pools is not None else iter(())

    def _scrape_errors(self, replica_id: str) -> int:
        return self.scraper.errors(replica_id) if self.scraper is not None else 0

    # -- ASGI ------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        admin_port = self.cfg.server.admin_port
        if admin_port is not None and scope.get("server", (None, None))[1] == admin_port:
            return await self._admin_port_http(scope, receive, send, path)
        if path in KINDS:
            if method != "POST":
                return await _error(send, MethodNotAllowed(f"Use POST for {path}."))
            assert self.proxy is not None
            return await self.proxy.handle(scope, receive, send)
        if match_stored(path):  # a stored response: GET, or POST .../cancel, at its replica
            assert self.proxy is not None
            return await self.proxy.handle_stored(scope, receive, send)
        page = self._get.get(path)
        if page is not None and not (admin_port is not None and path == "/metrics"):
            if method not in ("GET", "HEAD"):
                return await _error(send, MethodNotAllowed(f"Use GET for {path}."))
            status, headers, body = page()
            return await _respond(send, status, headers, body)
        if admin_port is None and await self._to_mount(scope, receive, send, path):
            return None
        return await _error(send, NotFound(f"Unknown path {path}."))

    async def _admin_port_http(
        self, scope: Scope, receive: Receive, send: Send, path: str
    ) -> None:
        """The separate admin port (`server.admin_port`): the admin API, /metrics (tenant ids
        and replica addresses stay off the public port), /healthz and /readyz only."""
        if path == "/healthz":
            return await _respond(send, *self._healthz())
        if path == "/readyz":
            return await _respond(send, *self._readyz())
        if path == "/metrics":
            return await _respond(send, *self._metrics_page())
        if not await self._to_mount(scope, receive, send, path):
            await _error(send, NotFound(f"Unknown path {path} on the admin port."))

    async def _to_mount(self, scope: Scope, receive: Receive, send: Send, path: str) -> bool:
        for prefix, app in self._mounts:
            if path == prefix or path.startswith(prefix + "/"):
                await app(scope, receive, send)  # type: ignore[misc]
                return True
        return False

    # -- plain pages -----------------------------------------------------------------------
    def _healthz(self) -> Page:
        return 200, JSON, b'{"status":"ok"}'

    def _readyz(self) -> Page:
        """Ready: every pool has a usable replica and tenancy state is loaded and fresh
        enough. A Redis outage alone keeps the gateway ready (it serves its last known
        state) but says so: ``"degraded": true``."""
        pools_ok = self.pools is not None and self.pools.ready(self.clock())
        info: dict[str, Any] = {"pools": "ready" if pools_ok else "not ready"}
        ok = pools_ok
        if self.tenancy is not None:
            h = self.tenancy.resolver.health()
            limiter_down = self.tenancy.limiter.degraded
            max_stale = self.tenancy.settings.max_staleness_s
            usable = h.loaded and (max_stale is None or h.staleness_s <= max_stale)
            ok = ok and usable
            info["tenancy"] = {
                "store": "redis" if self.tenancy.settings.redis_url else "memory",
                "degraded": h.degraded or limiter_down,
                "reason": h.reason or ("rate limits are per-process" if limiter_down else None),
                "policy_version": h.policy_version, "staleness_s": round(h.staleness_s, 3),
                "store_resets": h.store_resets,
            }
        degraded = bool(info.get("tenancy", {}).get("degraded"))
        if self.sync is not None:
            info["sync"] = {"degraded": self.sync.degraded, "member": self.sync.member,
                            "peers": self.router.peers.members(self.clock())
                            if self.router.peers else 0}
            degraded = degraded or self.sync.degraded
        info = {"status": "ready" if ok else "not ready", "degraded": degraded, **info}
        return (200 if ok else 503), JSON, orjson.dumps(info)

    def _metrics_page(self) -> Page:
        return 200, [(b"content-type", CONTENT_TYPE)], self.metrics.render()

    def _models(self) -> Page:
        names = self.pools.model_names() if self.pools is not None else []
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "kvgate"} for n in names]
        doc: dict[str, Any] = {"object": "list", "data": data}
        now = self.clock()
        not_ready = [
            {"pool": p.name, "reason": "no healthy replica" if p.served_model
             else "served model not known yet (no replica answered)"}
            for p in (self.pools.by_name.values() if self.pools is not None else ())
            if not (p.served_model and any(r.available(now) for r in p.replicas))
        ]
        if not_ready:  # kvgate's addition; OpenAI clients ignore unknown fields
            doc["not_ready"] = not_ready
        return 200, JSON, orjson.dumps(doc)

    # -- lifespan --------------------------------------------------------------------------
    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:  # reported to uvicorn, which exits
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        gate = await self._start_tenancy()
        assert self.tenancy is not None
        snap = self.tenancy.resolver.policy  # the store's policy, once seeded from config
        self.pools = Pools(self.cfg, snap.doc if snap is not None else self.cfg.policy_doc())
        # registered before the next await, so no policy version can slip in between
        self._unsubscribe = self.tenancy.resolver.on_policy(self._policy_changed)
        self.proxy = Proxy(self.cfg, self.pools, self.router, self.metrics, self.clock, gate)
        await self._start_discovery()
        monitor = HealthMonitor(self.pools, self.cfg.health, self.clock)
        await monitor.poll_once()  # know who is up (and the served names) before serving
        self._tasks.append(asyncio.create_task(monitor.run(), name="kvgate-health"))
        self._tasks.append(asyncio.create_task(self._reap_drained(), name="kvgate-drain"))
        await self._start_scraper()
        await self._start_sync()
        await self._start_doctor(gate)
        self._mount_admin(gate)
        if self.after_start is not None:
            await self.after_start(self)
        log.info("gateway started", extra={"pools": list(self.pools.by_name)})

    async def _start_tenancy(self) -> TenantGate:
        tcfg = self.cfg.tenancy
        secret, salted = auth_secret(self.cfg)
        redis_url = self.cfg.redis_url.get_secret_value() if self.cfg.redis_url else None
        settings = TenancySettings(
            redis_url=redis_url, namespace=tcfg.namespace, redis_timeout_s=tcfg.redis_timeout_s,
            poll_interval_s=tcfg.poll_interval_s, max_staleness_s=tcfg.max_staleness_s,
            client_salt=tcfg.client_salt, salt_encoding=tcfg.salt_encoding,
            gateway_replicas=tcfg.gateway_replicas,
        )
        self.tenancy = build_tenancy(settings, secret)
        tenants = [Tenant(id=t.id, tier=t.tier, salt_group=t.salt_group) for t in self.cfg.tenants]
        if not tcfg.auth:  # the 'default' tier: models' default pools, no limits unless set
            tenants.append(Tenant(id=NO_AUTH_TENANT, tier=DEFAULT_TIER))
        await self.tenancy.start(tenants=tenants, policy=self.cfg.policy_doc())
        labels = TenantLabels(tcfg.metrics_tenants, tcfg.metrics_max_tenants)
        self.gate = TenantGate(self.tenancy, auth=tcfg.auth, salted=salted,
                               client_salt=tcfg.client_salt, labels=labels)
        gate = self.gate
        self.metrics.watch_tenancy(
            lambda: (gate.redis_up(), gate.tenancy.resolver.health().policy_version)
        )
        self.metrics.registry.register(TenancyCollector(self.tenancy.resolver))
        return gate

    def _policy_changed(self, snap: PolicySnapshot) -> None:
        """A new policy version: follow its pools (the scraper, router, discovery follow too)."""
        if self.pools is None:
            return
        changes = self.pools.apply(snap.doc)
        self._follow(changes)
        task = asyncio.create_task(self.discovery.sync(snap.doc.pools))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        log.info("policy applied", extra={"version": snap.version, "added": len(changes.added),
                                          "removed": len(changes.removed)})

    async def _start_discovery(self) -> None:
        """Sources for the pools that have `discovery`; wait (bounded) for their first sets."""
        assert self.pools is not None
        try:
            await self.discovery.sync(self.pools.doc.pools, strict=True)
        except DiscoveryConfigError as exc:
            raise ConfigError(str(exc)) from None
        if self.discovery.pools:
            late = await self.discovery.wait_synced(DISCOVERY_FIRST_SYNC_S)
            if late:
                log.warning("discovery not synced yet; those pools start empty",
                            extra={"pools": late})

    def _discovered(self, pool: str, urls: frozenset[str]) -> None:
        """Discovery's `on_change` (sync, on the loop): re-list the pool; leavers drain."""
        if self.pools is None:
            return
        changes = self.pools.set_discovered(pool, urls)
        self._follow(changes)
        if changes:
            log.info("pool replicas changed", extra={
                "pool": pool, "replicas": len(urls),
                "added": [r.id for r in changes.added],
                "draining": [r.id for r in changes.removed]})

    def _follow(self, changes: PoolChanges) -> None:
        """Scrape the new replicas; stop scraping the ones that started draining."""
        for replica in changes.removed:
            if self._by_id.get(replica.id) is replica:
                del self._by_id[replica.id]
                if self.scraper is not None:
                    self.scraper.remove_target(replica.id)
        for replica in changes.added:
            self._by_id[replica.id] = replica
            if self.sync is not None:
                replica.watch = self.sync.wake
            if self.scraper is not None:
                self.scraper.add_target(replica.id, replica.url)

    async def _reap_drained(self) -> None:
        """Forget drained replicas once their last in-flight request has finished."""
        assert self.pools is not None
        pools = self.pools
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            for replica in pools.reap():
                if not any(r.id == replica.id for r in pools.replicas()):
                    self.router.forget_replica(replica.id)
                log.info("replica drained", extra={"pool": replica.pool, "replica": replica.id})

    def _mount_admin(self, gate: TenantGate) -> None:
        assert self.pools is not None and self.proxy is not None and self.tenancy is not None
        token = self.cfg.admin_token.get_secret_value() if self.cfg.admin_token else None
        try:
            tokens = admin_tokens_from_env(token)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        live = LiveViews(self.pools, self.router, self.proxy.planner, gate, self.scraper,
                         self.clock)
        deps = AdminDeps(self.tenancy.store, tokens, replicas=live.replicas, explain=live.explain,
                         doctor=self.doctor.report if self.doctor is not None else None)
        self.metrics.registry.register(AuthGuardCollector(deps.guard))
        self.mount("/admin", guard_json_depth(create_admin_app(  # too deep: 400 first
            deps, openapi_url="/admin/openapi.json", docs_url="/admin/docs")))

    async def _start_scraper(self) -> None:
        """Poll every replica's vLLM /metrics; samples land on the replica (`record_scrape`)."""
        assert self.pools is not None
        by_id = self._by_id = {r.id: r for r in self.pools.replicas()}
        self._scrape_client = httpx.AsyncClient()

        def on_sample(replica_id: str, sample: Sample | None, now: float) -> None:
            replica = by_id.get(replica_id)
            if replica is not None:
                replica.record_scrape(sample, now)
                counters = sample.engine_counters() if sample is not None else None
                if counters is not None:  # every request teaches the TTFT model
                    self.router.record_counters(replica_id, counters, now)

        interval = self.cfg.routing.scrape_interval_ms / 1000.0
        self.scraper = Scraper(
            self._scrape_client, on_sample, interval_s=interval,
            timeout_s=max(0.5, 4 * interval), clock=self.clock,
        )
        for replica in by_id.values():
            self.scraper.add_target(replica.id, replica.url)
        await self.scraper.start()

    async def _start_sync(self) -> None:
        """Share routing state with the other gateway processes (Redis only)."""
        sc = self.cfg.sync
        url = self.cfg.redis_url.get_secret_value() if self.cfg.redis_url else None
        if url and sc.enabled:
            settings = SyncSettings(
                flush_interval_s=sc.flush_interval_ms / 1000.0, heartbeat_s=sc.heartbeat_s,
                stale_after_s=sc.stale_after_s, stream_maxlen=sc.stream_maxlen,
                catchup_entries=sc.catchup_entries, max_entries_per_tick=sc.max_entries_per_tick,
                timeout_s=sc.timeout_s,
            )
            by_id = self._by_id
            self.sync = RouteSync(
                self.router, url, self.cfg.tenancy.namespace, settings, self._own_loads,
                by_id.__contains__, self.clock,
            )
            for replica in self._described():
                replica.watch = self.sync.wake
            await self.sync.start()
            log.info("shared routing state on", extra={"member": self.sync.member})
        self.metrics.registry.register(SyncCollector(self.router, self.sync, self.clock))

    async def _start_doctor(self, gate: TenantGate) -> None:
        """`kvgate doctor`: the rolling history (gateway/doctor/) and its routing-time probe."""
        assert self.proxy is not None
        sync = self.sync
        self.doctor = build_doctor(
            self.cfg, self.router, self.metrics, self._described, self._scrape_errors,
            redis_up=gate.redis_up, sync_degraded=lambda: sync.degraded if sync else None,
            clock=self.clock)
        self.proxy.prep.sharing = self.doctor.sharing
        await self.doctor.start()

    def _own_loads(self) -> dict[str, ReplicaLoad]:
        """This process's own load per replica (published to the other gateways)."""
        pending = self.router.own_load
        return {
            r.id: ReplicaLoad(r.inflight, r.inflight_prefill, r.inflight_prefill_tokens,
                              pending(r.id) if r.inflight else 0.0)
            for r in self._described()
        }

    async def shutdown(self) -> None:
        self._unsubscribe()  # no policy version may start discovery sources any more
        self._unsubscribe = lambda: None
        if self.doctor is not None:
            await self.doctor.stop()
        if self.sync is not None:
            await self.sync.stop()
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.discovery.stop()
        if self.tenancy is not None:
            await self.tenancy.close()
        if self.scraper is not None:
            await self.scraper.stop()
            await self._scrape_client.aclose()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.pools is not None:
            await self.pools.close()


def _version_page() -> Page:
    """`GET /version`, as vLLM's: ``{"version": ...}`` (kvgate's own version)."""
    return 200, JSON, orjson.dumps({"version": __version__})


async def _respond(send: Send, status: int, headers: Headers, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _error(send: Send, exc: KvgateError) -> None:
    await _respond(send, exc.status, exc.headers(), exc.body())
