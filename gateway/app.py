"""The gateway as one plain ASGI application.

Proxied routes skip any framework: a dict lookup on the path, then `Proxy.handle`. The app's
lifespan owns everything long-lived (pools and their transports, the health poller) and
creates it at start-up, cancels and awaits it at shutdown. Other ASGI apps (the admin API)
mount under a path prefix with `mount`. vLLM's operator endpoints (`/sleep`, `/reset_prefix_cache`,
`/collective_rpc`, ...) are not routes here, so they are never reachable through kvgate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import httpx
import orjson

from gateway.asgi import Receive, Scope, Send
from gateway.config import KvgateConfig
from gateway.errors import KvgateError, NotFound
from gateway.health import HealthMonitor
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.pool import Pools
from gateway.proxy import KINDS, Proxy
from gateway.replicas import Replica
from gateway.scrape import Sample, Scraper
from routing.router import Router

__all__ = ["GatewayApp"]

log = logging.getLogger(__name__)
Headers = list[tuple[bytes, bytes]]
Page = tuple[int, Headers, bytes]
JSON: Headers = [(b"content-type", b"application/json")]


class MethodNotAllowed(KvgateError):
    status = 405
    type_ = "MethodNotAllowedError"


class GatewayApp:
    def __init__(self, cfg: KvgateConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.router = Router(cfg.routing.router_config())
        self.metrics = GatewayMetrics(self._all_replicas, clock)
        self.pools: Pools | None = None
        self.proxy: Proxy | None = None
        self.scraper: Scraper | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._mounts: list[tuple[str, Callable[..., object]]] = []
        self._get = {
            "/healthz": self._healthz, "/readyz": self._readyz,
            "/metrics": self._metrics_page, "/v1/models": self._models,
        }

    def mount(self, prefix: str, app: Callable[..., object]) -> None:
        """Route `prefix/...` to another ASGI app (e.g. the FastAPI admin API)."""
        self._mounts.append((prefix.rstrip("/"), app))

    def _all_replicas(self) -> Iterator[Replica]:
        return self.pools.replicas() if self.pools is not None else iter(())

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
        if path in KINDS:
            if method != "POST":
                return await _error(send, MethodNotAllowed(f"Use POST for {path}."))
            assert self.proxy is not None
            return await self.proxy.handle(scope, receive, send)
        page = self._get.get(path)
        if page is not None:
            if method not in ("GET", "HEAD"):
                return await _error(send, MethodNotAllowed(f"Use GET for {path}."))
            status, headers, body = page()
            return await _respond(send, status, headers, body)
        for prefix, app in self._mounts:
            if path == prefix or path.startswith(prefix + "/"):
                await app(scope, receive, send)  # type: ignore[misc]
                return None
        return await _error(send, NotFound(f"Unknown path {path}."))

    # -- plain pages -----------------------------------------------------------------------
    def _healthz(self) -> Page:
        return 200, JSON, b'{"status":"ok"}'

    def _readyz(self) -> Page:
        ready = self.pools is not None and self.pools.ready(self.clock())
        return (200, JSON, b'{"status":"ready"}') if ready else (
            503, JSON, b'{"status":"not ready"}')

    def _metrics_page(self) -> Page:
        return 200, [(b"content-type", CONTENT_TYPE)], self.metrics.render()

    def _models(self) -> Page:
        names = sorted(self.pools.public) if self.pools is not None else []
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "kvgate"} for n in names]
        return 200, JSON, orjson.dumps({"object": "list", "data": data})

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
        self.pools = Pools(self.cfg)
        self.proxy = Proxy(self.cfg, self.pools, self.router, self.metrics, self.clock)
        monitor = HealthMonitor(self.pools, self.cfg.health, self.clock)
        await monitor.poll_once()  # know who is up (and the served names) before serving
        self._tasks.append(asyncio.create_task(monitor.run(), name="kvgate-health"))
        await self._start_scraper()
        log.info("gateway started", extra={"pools": list(self.pools.by_name)})

    async def _start_scraper(self) -> None:
        """Poll every replica's vLLM /metrics; samples land on the replica (`record_scrape`)."""
        assert self.pools is not None
        by_id = {r.id: r for r in self.pools.replicas()}
        self._scrape_client = httpx.AsyncClient()

        def on_sample(replica_id: str, sample: Sample | None, now: float) -> None:
            replica = by_id.get(replica_id)
            if replica is not None:
                replica.record_scrape(sample, now)

        interval = self.cfg.routing.scrape_interval_ms / 1000.0
        self.scraper = Scraper(
            self._scrape_client, on_sample, interval_s=interval,
            timeout_s=max(0.5, 4 * interval), clock=self.clock,
        )
        for replica in by_id.values():
            self.scraper.add_target(replica.id, replica.url)
        await self.scraper.start()

    async def shutdown(self) -> None:
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


async def _respond(send: Send, status: int, headers: Headers, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _error(send: Send, exc: KvgateError) -> None:
    await _respond(send, exc.status, exc.headers(), exc.body())
