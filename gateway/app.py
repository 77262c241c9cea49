"""The gateway as one plain ASGI application: dispatch and pages.

Proxied routes skip any framework: a dict lookup on the path, then `Proxy.handle`. Everything
long-lived (tenancy, pools and their transports, discovery, health polling, the scraper,
shared routing state, the doctor, the admin API) is `gateway.runtime`'s: the lifespan starts
it on one `AsyncExitStack` and closes the stack at shutdown. The admin API (FastAPI) is
mounted at ``/admin``. vLLM's operator endpoints (`/sleep`, `/reset_prefix_cache`,
`/collective_rpc`, ...) are not routes here, so they are never reachable through kvgate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import orjson

from gateway import __version__
from gateway.anthropic_errors import error_body
from gateway.apikey import KEY_HEADERS, KeyScan
from gateway.asgi import Headers, Receive, Scope, Send, send_whole
from gateway.config import KvgateConfig
from gateway.cors import Cors, origin_of
from gateway.errors import KvgateError, MethodNotAllowed, ModelNotFound, NotFound, shown_name
from gateway.metrics import CONTENT_TYPE, GatewayMetrics
from gateway.multipart import FORM_ROUTES
from gateway.paths import (
    API_PREFIX,
    api_route,
    canonical,
    deployment_route,
    prefixed_route,
    stored_subroute,
)
from gateway.policy_doc import DEFAULT_TIER
from gateway.proxy import KINDS, MODEL_PREFIX, MODELS
from gateway.replicas import Replica
from gateway.runtime import Runtime, start_runtime
from gateway.split_ports import on_admin_port
from gateway.stored import match_stored
from gateway.tenancy.resolver import Principal
from gateway.tokenizer_info import TOKENIZER_INFO, TokenizerInfo
from gateway.transport import TransportFactory, default_transport
from gateway.vllm_routes import VLLM_KINDS
from routing.router import Router

__all__ = ["GatewayApp", "Page", "unknown_path"]

log = logging.getLogger(__name__)
Page = tuple[int, Headers, bytes]
JSON: Headers = [(b"content-type", b"application/json")]
ADMIN_PREFIX = "/admin"
POSTED = frozenset({"/ping"})  # kvgate's pages vLLM also answers to POST (SageMaker's probe)


class GatewayApp:
    def __init__(
        self,
        cfg: KvgateConfig,
        clock: Callable[[], float] = time.monotonic,
        after_start: Callable[[GatewayApp], Awaitable[None]] | None = None,
        transport: TransportFactory = default_transport,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.after_start = after_start  # e.g. `kvgate demo` creating its tenants' keys
        self.transport = transport  # the pools' upstream client (tests: an in-process one)
        self.router = Router(cfg.routing.router_config())
        self.metrics = GatewayMetrics(
            self._described, clock, scrape_errors=self._scrape_errors,
            affinity=self.router.affinity_entries,
            pools=lambda: self.rt.pools.by_name if self.rt is not None else (),
        )
        self.rt: Runtime | None = None  # set once started
        self.cors = Cors.from_config(cfg.server)  # None: CORS off (gateway/cors.py)
        self._stack: AsyncExitStack | None = None
        self._get = {
            "/healthz": self._healthz, "/livez": self._healthz, "/readyz": self._readyz,
            "/metrics": self._metrics_page, MODELS: self._models,
            # vLLM's operational paths, for drop-in use (benchmark clients probe /health)
            "/health": self._healthz, "/ping": self._healthz, "/version": _version_page,
        }
        self._admin_port_pages = {"/healthz": self._healthz, "/livez": self._healthz,
                                  "/readyz": self._readyz, "/metrics": self._metrics_page}

    def refusal_cors(self, origin: bytes, port: int | None) -> Headers | None:
        """The CORS headers of an answer the HTTP guard gives on its own (400/408/431,
        `gateway/httpguard.py`) to a request from `origin` on local `port`: as kvgate's
        other answers, none on the admin port."""
        if self.cors is None or (port is not None and port == self.cfg.server.admin_port):
            return None
        return self.cors.allowed(origin)

    def unread_answer(self) -> None:
        """The HTTP guard reset a connection whose client did not read the answer written to
        it (`gateway/writewatch.py`)."""
        self.metrics.unread_answers.inc()

    def _described(self) -> Iterator[Replica]:
        return self.rt.pools.described() if self.rt is not None else iter(())

    def _scrape_errors(self, replica_id: str) -> int:
        return self.rt.scraper.errors(replica_id) if self.rt is not None else 0

    # -- ASGI ------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if path[-1:] == "/" or "//" in path:
            # `/v1/chat/completions/` (vLLM redirects it to the route, and clients follow it
            # with the body) and `//v1/...` are served as the route (`gateway/paths.py`)
            path = scope["path"] = canonical(path)
        method: str = scope["method"]
        admin_port = self.cfg.server.admin_port
        if admin_port is not None and scope.get("server", (None, None))[1] == admin_port:
            return await self._admin_port_http(scope, receive, send, path)
        rt = self.rt
        if path in KINDS and method == "POST":
            assert rt is not None
            return await rt.proxy.handle(scope, receive, send)  # CORS: `Proxy.handle`
        cors = self.cors  # kvgate's own pages (not the hot path), never the admin API
        if cors is not None and not _is_admin(path):
            if method == "OPTIONS" and await self._preflight(scope, send):
                return None
            if (extra := cors.allowed(origin_of(scope["headers"]))) is not None:
                send = cors.wrap(send, extra)
        if path in KINDS:  # (Anthropic's shape on its routes: `gateway.anthropic_errors`)
            exc = MethodNotAllowed(f"Use POST for {shown_name(path)}.", allow="POST")
            return await send_whole(send, exc.status, exc.headers(), error_body(path, exc))
        if path == TOKENIZER_INFO and rt is not None:  # vLLM's one GET route for clients
            if method in ("GET", "HEAD"):  # (uvicorn leaves a HEAD's body out)
                return await TokenizerInfo(rt.proxy.prep, rt.pools, self.cfg.upstream,
                                           self.clock, self.cfg.server.replica_header
                                           ).answer(scope, send)
            return await _error(send, MethodNotAllowed(f"Use GET for {path}.",
                                                       allow="GET, HEAD"))
        if match_stored(path):  # a stored response: GET, or POST .../cancel, at its replica
            if (beyond := stored_subroute(path)) is not None:  # `.../input_items`, ...
                return await _error(send, beyond)
            assert rt is not None
            return await rt.proxy.handle_stored(scope, receive, send)
        if path[-1:] == "/" and path[:-1] in self._get:  # `/health/`: vLLM (FastAPI) redirects
            path = path[:-1]  # it to `/health`, and probes and clients follow: served as that
        page = self._get.get(path)
        model = path[len(MODELS) + 1:] if path.startswith(MODEL_PREFIX) else ""
        if model:  # `GET /v1/models/{model}`, the SDK's `models.retrieve` (a name may hold "/")
            page = partial(self._model, model)
        if page is not None and not (admin_port is not None and path == "/metrics"):
            if method not in ("GET", "HEAD") and not (method == "POST" and path in POSTED):
                allow = "GET, HEAD, POST" if path in POSTED else "GET, HEAD"
                return await _error(
                    send, MethodNotAllowed(f"Use GET for {shown_name(path)}.", allow=allow))
            if (path == MODELS or model) and rt is not None:
                try:  # as OpenAI and vLLM --api-key: listing models needs a valid key
                    principal = rt.proxy.prep.authenticate(_bearer_token(scope["headers"]))
                except KvgateError as exc:
                    return await _error(send, exc)
                page = partial(self._model, model, principal) if model else partial(
                    self._models, principal)
            status, headers, body = page()
            return await send_whole(send, status, headers, body)
        if admin_port is None and await self._to_admin(scope, receive, send, path):
            return None
        return await _error(send, unknown_path(path))

    async def _admin_port_http(
        self, scope: Scope, receive: Receive, send: Send, path: str
    ) -> None:
        """The separate admin port (`server.admin_port`): the admin API, /metrics (tenant ids
        and replica addresses stay off the public port), /healthz (/livez) and /readyz only."""
        page = self._admin_port_pages.get(path)
        if page is not None:
            if scope["method"] not in ("GET", "HEAD"):
                return await _error(
                    send, MethodNotAllowed(f"Use GET for {shown_name(path)}.", allow="GET, HEAD"))
            return await send_whole(send, *page())
        if not await self._to_admin(scope, receive, send, path):
            await _error(send, on_admin_port(path))

    async def _preflight(self, scope: Scope, send: Send) -> bool:
        """A CORS preflight from an allowed origin: 204, answered here (no key, no limit, no
        replica, not a request in the metrics). False when it is not one (then answered as
        any OPTIONS request: 405, or 404 on an unknown path)."""
        assert self.cors is not None
        headers = self.cors.preflight(scope["headers"])
        if headers is None:
            return False
        await send_whole(send, 204, headers, b"")
        return True

    async def _to_admin(self, scope: Scope, receive: Receive, send: Send, path: str) -> bool:
        if self.rt is None or not _is_admin(path):
            return False
        await self.rt.admin(scope, receive, send)
        return True

    # -- plain pages -----------------------------------------------------------------------
    def _healthz(self) -> Page:
        """Alive (/healthz, /livez, vLLM's /health and /ping): the event loop answers. Never
        Redis's or a replica's state: a restart cures neither (that is /readyz's)."""
        return 200, JSON, b'{"status":"ok"}'

    def _readyz(self) -> Page:
        """Ready: some pool can serve (a usable replica, its model known) and tenancy state
        is loaded and fresh enough. A pool without a usable replica keeps the gateway ready
        when another can serve, and says so (``"degraded": true``, ``"not_ready"``): every
        gateway pod sees the same replicas, so failing readiness for one pool would take
        all of them out of the Service and the other pools' traffic with it (its clients
        get a clear 503 instead). A Redis outage alone keeps the gateway ready too (it
        serves its last known state), also degraded."""
        rt = self.rt
        not_ready = rt.pools.not_ready(self.clock()) if rt is not None else {}
        pools_ok = rt is not None and len(not_ready) < len(rt.pools.by_name)
        info: dict[str, Any] = {"pools": "ready" if pools_ok else "not ready"}
        if not_ready:
            info["not_ready"] = not_ready
        ok = pools_ok
        if rt is not None:
            tenancy = rt.tenancy
            h = tenancy.resolver.health()
            limiter_down = tenancy.limiter.degraded
            max_stale = tenancy.settings.max_staleness_s
            usable = h.loaded and (max_stale is None or h.staleness_s <= max_stale)
            ok = ok and usable
            info["tenancy"] = {
                "store": "redis" if tenancy.redis_url else "memory",
                "degraded": h.degraded or limiter_down,
                "reason": "; ".join(r for r in (h.reason, "rate limits are per-process"
                                                if limiter_down else None) if r) or None,
                "policy_version": h.policy_version, "staleness_s": round(h.staleness_s, 3),
                "store_resets": h.store_resets, "store_wiped": h.store_wiped,
                "records_skipped": h.records_skipped,
            }
        degraded = bool(info.get("tenancy", {}).get("degraded")) or bool(not_ready)
        if rt is not None and rt.sync is not None:
            info["sync"] = {"degraded": rt.sync.degraded, "member": rt.sync.member,
                            "peers": self.router.peers.members(self.clock())
                            if self.router.peers else 0}
            if rt.sync.degraded:  # why, as the log says it (it said only "degraded")
                info["sync"]["reason"] = rt.sync.reach.cause
            degraded = degraded or rt.sync.degraded
        info = {"status": "ready" if ok else "not ready", "degraded": degraded, **info}
        return (200 if ok else 503), JSON, orjson.dumps(info)

    def _metrics_page(self) -> Page:
        return 200, [(b"content-type", CONTENT_TYPE)], self.metrics.render()

    def _models(self, principal: Principal | None = None) -> Page:
        """The public models the caller's tier can use, as OpenAI lists the models of a key
        (clients take `data[0].id`), with the pools that cannot serve now."""
        rt = self.rt
        pools = rt.pools if rt is not None else None
        names = rt.proxy.planner.offered(principal) if rt and principal else []
        data = [self._model_card(n, principal) for n in names]
        doc: dict[str, Any] = {"object": "list", "data": data}
        not_ready = [{"pool": name, "reason": why} for name, why in
                     (pools.not_ready(self.clock(), operator=False)
                      if pools is not None else {}).items()]  # no replica address
        if not_ready:  # kvgate's addition; OpenAI clients ignore unknown fields
            doc["not_ready"] = not_ready
        return 200, JSON, orjson.dumps(doc)

    def _model(self, name: str, principal: Principal | None = None) -> Page:
        rt = self.rt
        if rt is None or principal is None or name not in rt.proxy.planner.offered(principal):
            exc = (rt.proxy.planner.not_found(principal, name) if rt and principal
                   else ModelNotFound(name))
            return exc.status, exc.headers(), exc.body()
        return 200, JSON, orjson.dumps(self._model_card(name, principal))

    def _model_card(self, name: str, principal: Principal | None) -> dict[str, Any]:
        """vLLM's model card for a public name: ``created`` is when this gateway first knew
        the model, ``max_model_len`` the serving pool's replicas' (omitted until known)."""
        rt = self.rt
        card: dict[str, Any] = {"id": name, "object": "model", "created": int(time.time()),
                                "owned_by": "kvgate", "root": name, "parent": None}
        if rt is None:
            return {**card, "permission": [_permission(card["created"])]}
        card["created"] = rt.pools.seen.get(name, card["created"])
        doc = principal.policy.doc if principal and principal.policy else rt.pools.doc
        pool = rt.pools.serving(name, doc, principal.tier if principal else DEFAULT_TIER)
        if pool is not None and pool.max_model_len is not None:
            card["max_model_len"] = pool.max_model_len
        if pool is not None and name != pool.served_model and pool.adapter_holders(name):
            card["parent"] = pool.served_model  # a LoRA adapter's card names its base, as vLLM's
        card["permission"] = [_permission(card["created"])]
        return card

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
        """Start the runtime; a start that fails half way stops what had started."""
        stack = AsyncExitStack()
        try:
            self.rt = await start_runtime(self.cfg, self.router, self.metrics, self.clock, stack,
                                          self.transport)
            await self.started(self.rt, stack)
            if self.after_start is not None:
                await self.after_start(self)
        except BaseException:
            self.rt = None
            await stack.aclose()
            raise
        self._stack = stack
        # what an operator checks first: which file was read, which store holds the keys and
        # limits (and whether the policy in force is the file's or the store's), the pools
        tenancy = self.rt.tenancy
        reach = tenancy.store.reach
        log.info("gateway started", extra={
            "pools": list(self.rt.pools.by_name), "config": self.cfg.source,
            "store": f"redis at {reach.address}" if reach is not None else "memory",
            "auth": self.cfg.tenancy.auth, "policy": tenancy.resolver.policy_source})

    async def started(self, rt: Runtime, stack: AsyncExitStack) -> None:
        """A hook for what serves beside the HTTP routes (the picker's gRPC server): start
        it and push its stop onto ``stack``."""

    async def shutdown(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()


def _is_admin(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


def _version_page() -> Page:
    """`GET /version`, as vLLM's: ``{"version": ...}`` (kvgate's own version)."""
    return 200, JSON, orjson.dumps({"version": __version__})


def _permission(created: int) -> dict[str, Any]:
    """The ``permission`` entry of vLLM's model card (its defaults: sampling, logprobs and
    viewing allowed; kvgate's access rules are its tiers, not this object)."""
    return {"id": f"modelperm-kvgate-{created}", "object": "model_permission",
            "created": created, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}


def _bearer_token(headers: Headers) -> str | None:
    """As the proxied routes read it (`request.scan_headers`, `gateway.apikey`)."""
    keys = KeyScan()
    for key, value in headers:
        if key in KEY_HEADERS:
            keys.add(key, value)
    return keys.key


# what vLLM 0.34 serves its clients beside the routes kvgate proxies (`KINDS`; not its
# operator endpoints, which stay unknown paths): a client that used them against vLLM is told so
VLLM_ONLY = frozenset({
    "/tokenizer_info", "/v2/embed", "/cohere/v2/chat", "/v1/chat/completions/batch",
    "/invocations", "/v1/realtime",
})


# the OpenAI API routes, as 404s name them (vLLM's own routes it serves too: `VLLM_KINDS`)
SERVED = f"{', '.join(p for p in KINDS if p not in VLLM_KINDS and p not in FORM_ROUTES)} " \
    f"and {MODELS}"


def unknown_path(path: str) -> NotFound:
    """404, with a hint when the path is an API route without its /v1 (a base URL without it),
    an Azure OpenAI deployment's, one of vLLM's own client endpoints, or another path under
    /v1 (an OpenAI route neither serves: files, batches, audio speech, ...): the routes
    kvgate serves. vLLM's operator endpoints (`/sleep`, ...) get a bare 404."""
    with_v1 = f"/v1{path}"
    if api_route(with_v1):
        return NotFound(f"Unknown path {shown_name(path)}. Did you mean {shown_name(with_v1)}? "
                        "(the base URL ends in /v1)")
    if (prefixed := prefixed_route(path)) is not None:
        return prefixed
    if (deployment := deployment_route(path)) is not None:  # the AzureOpenAI client's paths
        return deployment
    if path.startswith("/v1/") and path[3:] in VLLM_KINDS:  # `/v1/tokenize`: a base URL's /v1
        return NotFound(f"Unknown path {shown_name(path)}. Did you mean {path[3:]}? (vLLM "
                        "serves it outside /v1: use the base URL without /v1 for it)")
    if path in VLLM_ONLY:
        return NotFound(f"{path} is a vLLM endpoint that kvgate does not serve (it serves "
                        f"{SERVED}).")
    if f"{path}/".startswith(API_PREFIX):  # OpenAI's routes vLLM has not either (files, ...)
        return NotFound(f"Unknown path {shown_name(path)}: kvgate serves {SERVED}.")
    return NotFound(f"Unknown path {shown_name(path)}.")


async def _error(send: Send, exc: KvgateError) -> None:
    await send_whole(send, exc.status, exc.headers(), exc.body())
