"""The hot path: one proxied OpenAI request, from body to relayed response.

Per request: authenticate (in memory), read the body (size-limited), parse it once, admit it
against the tenant's limits (one store round trip; none for a tenant without limits), plan
the pool from the principal's policy snapshot (`Planner`: tier, spill-over, salted features),
rewrite the body, ask the router, then try the decision's replica and its fallbacks. The
admission is settled with the real usage in a ``finally``. A connect error, a reset or a
502/503/504 *before anything was sent to the client* moves on to the next replica (bounded by
`max_attempts` and the pool's retry budget). Once a streamed response has started, a failure
ends it with an SSE error event and ``data: [DONE]``. Every lease on a replica's counters is
released in a ``finally``; client disconnects and timeouts cancel the handler task (see
`Canceller`), which closes the upstream connection so the replica aborts the generation.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
from collections.abc import Callable
from time import perf_counter

from gateway.asgi import Receive, Scope, Send
from gateway.body import ParsedBody, parse_body, rewrite_body
from gateway.config import KvgateConfig
from gateway.errors import (
    KvgateError,
    NoReplicaAvailable,
    UpstreamError,
    UpstreamTimeout,
    error_body,
)
from gateway.logs import log_request
from gateway.metrics import GatewayMetrics
from gateway.pool import Pool, Pools
from gateway.replicas import Lease, Replica
from gateway.request import ProxiedRequest, read_body, scan_headers
from gateway.sse import StreamScanner, scan_usage
from gateway.tenancy.edge import TenantGate
from gateway.tenancy.planner import Planner
from gateway.tenancy.resolver import Principal
from gateway.timeouts import Canceller
from gateway.transport import TRANSPORT_ERRORS, UpstreamResponse
from routing.router import NoCandidate, Router
from routing.types import Decision

__all__ = ["KINDS", "Proxy"]

log = logging.getLogger(__name__)

# proxied route -> (kind, upstream path)
KINDS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
}
RETRY_STATUSES = frozenset({502, 503, 504})
RELAY_SAMPLE = 16  # time the relay of one streamed chunk in this many (and the first)
# a streamed event carrying generated output: chat `content`/`reasoning_content`, completions
# `text`, tool-call `arguments`, responses' text `delta` -- a non-empty string value
_CONTENT = re.compile(rb'"(?:content|reasoning_content|text|arguments|delta)"\s*:\s*"[^"]')
DONE_EVENT = b"data: [DONE]\n\n"


class Proxy:
    def __init__(
        self, cfg: KvgateConfig, pools: Pools, router: Router, metrics: GatewayMetrics,
        clock: Callable[[], float], gate: TenantGate,
    ) -> None:
        self._cfg = cfg
        self._pools = pools
        self._gate = gate
        self.planner = Planner(pools, router.config, gate)
        self._router = router
        self._metrics = metrics
        self._clock = clock
        self._limit = cfg.server.max_body_bytes
        self._up = cfg.upstream
        # request ids: a random per-process prefix + a counter (unique, and cheaper than
        # reading the OS's random source per request)
        prefix = os.urandom(8).hex()
        counter = itertools.count()
        self._new_id: Callable[[], bytes] = lambda: f"{prefix}{next(counter):016x}".encode()

    # -- entry -------------------------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        req_id, declared, token = scan_headers(scope["headers"], self._new_id)
        req = ProxiedRequest(path, KINDS[path], req_id, perf_counter())
        try:
            try:
                decision, upstream_body = await self._admit_and_prepare(
                    req, receive, declared, token
                )
            except KvgateError as exc:
                await self._send_error(send, req, exc)
                return
            except asyncio.CancelledError:
                req.status = 499
                return  # client disconnected before its body arrived
            await self._run(send, receive, req, decision, upstream_body)
        finally:
            total = perf_counter() - req.t0
            self._metrics.finished(
                req.pool_name, req.replica, req.status, req.route, total, req.tier, req.tenant,
            )
            if log.isEnabledFor(logging.INFO):
                log_request(log, req, total)
            if req.adm is not None:
                await self._gate.finish(req.adm, req.settle_tokens())

    async def _run(
        self, send: Send, receive: Receive, req: ProxiedRequest, decision: Decision, body: bytes
    ) -> None:
        req.ctl = Canceller(self._up, receive)
        try:
            await self._forward(send, req, decision, body)
        except asyncio.CancelledError:
            if req.ctl.reason is None:
                raise  # shutdown or a real cancellation: not ours to swallow
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            await self._cancelled(send, req)
        except KvgateError as exc:
            await self._send_error(send, req, exc)
        finally:
            req.ctl.close()

    async def _admit_and_prepare(
        self, req: ProxiedRequest, receive: Receive, declared: int | None, token: str | None
    ) -> tuple[Decision, bytes]:
        gate = self._gate
        principal = gate.principal(token)  # before the body: no key, no upload
        req.tier, req.tenant = principal.tier, gate.labels(principal.tenant_id)
        req.tenant_id = principal.tenant_id
        body = await read_body(receive, self._limit, declared)
        parsed = req.parsed = parse_body(body, req.kind)
        adm = await gate.admit(principal, parsed.prompt_tokens)
        if adm is not None:
            req.extra = [(k.encode(), v.encode()) for k, v in adm.headers().items()
                         if k != "retry-after"]
            if not adm.allowed:
                self._metrics.rejected(req.tier, req.tenant, adm.reason or "rpm")
                raise adm.error()
            req.adm = adm
        return self._prepare(req, principal, parsed)

    def _prepare(
        self, req: ProxiedRequest, principal: Principal, parsed: ParsedBody
    ) -> tuple[Decision, bytes]:
        now = self._clock()
        plan = self.planner.plan(principal, parsed, req.kind, now)
        pool = req.pool = plan.pool
        req.pool_name, req.features, req.spilled = pool.name, plan.features, plan.spilled
        gate = self._gate
        upstream_body, req.strip = rewrite_body(
            parsed, req.kind, plan.served, cache_salt=gate.salt(principal),
            priority=plan.priority, client_salt=gate.client_salt,
            client_priority=gate.client_priority,
        )
        try:
            decision = self._router.pick(plan.features, plan.views, now)
        except NoCandidate:
            raise NoReplicaAvailable(
                f"No healthy replica for the model `{parsed.model}`.", retry_after=1
            ) from None
        if plan.spilled:
            self._metrics.spilled(principal.tier, plan.home, pool.name)
        return decision, upstream_body

    # -- attempts ----------------------------------------------------------------------------
    async def _forward(
        self, send: Send, req: ProxiedRequest, decision: Decision, body: bytes
    ) -> None:
        pool: Pool = req.pool
        # replicas that left the pool since the pick are skipped before counting attempts, so
        # `last` is really the last try (its 502/503/504 then reaches the client as it is)
        found = (pool.by_id.get(rid) for rid in (decision.replica, *decision.fallbacks))
        order = [r for r in found if r is not None][: self._up.max_attempts]
        pool.budget.deposit()
        req.route = "spill" if req.spilled else decision.reason
        headers = {**pool.headers, "X-Request-Id": req.req_id.decode("latin-1")}
        failure: UpstreamError | None = None  # built only when an attempt fails (rare)
        for i, replica in enumerate(order):
            if i > 0:
                if not pool.budget.try_spend():
                    break
                req.route = "retry"
            if i == 0:
                self._metrics.pre_upstream.observe(perf_counter() - req.t0)
            last = i + 1 == len(order) or pool.budget.tokens < 1.0
            failure_or_none = await self._attempt(send, req, replica, body, headers, last)
            if failure_or_none is None:
                if i > 0:
                    self._metrics.failover(pool.name)
                return
            failure = failure_or_none
            self._metrics.retried(pool.name, failure.reason)
        raise failure or UpstreamError("No replica answered.")

    async def _attempt(
        self, send: Send, req: ProxiedRequest, replica: Replica, body: bytes,
        headers: dict[str, str], last: bool,
    ) -> UpstreamError | None:
        """One try on `replica`; returns an error to retry elsewhere, None when answered."""
        req.replica = replica.id
        req.attempts += 1
        lease = replica.acquire(req.features.prompt_tokens)
        resp: UpstreamResponse | None = None
        clean = False
        try:
            req.ctl.attempt_started()
            self._router.record_route(replica.id, req.features, self._clock())
            try:
                resp = await req.pool.transport.post(replica.url + req.path, body, headers)
            except TRANSPORT_ERRORS:
                replica.record_failure(self._clock())
                log.info("replica did not answer", extra={"replica": replica.id})
                return UpstreamError("The replica did not answer.", reason="connect")
            if resp.status in RETRY_STATUSES and not last:
                if resp.status != 503:  # vLLM's 503 = busy (admission), not broken
                    replica.record_failure(self._clock())
                return UpstreamError(
                    f"The replica answered {resp.status}.", reason=f"status_{resp.status}"
                )
            clean = await self._relay(send, req, replica, resp, lease)
            return None
        finally:
            if not lease.answered:
                self._router.record_failure(replica.id, req.features, self._clock())
            lease.release()
            if resp is not None:
                resp.release() if clean else resp.abort()

    # -- relaying ----------------------------------------------------------------------------
    def _headers(self, req: ProxiedRequest, content_type: str) -> list[tuple[bytes, bytes]]:
        hdrs = [(b"content-type", content_type.encode("latin-1")), (b"x-request-id", req.req_id)]
        if self._cfg.server.replica_header:
            hdrs.append((b"x-kvgate-replica", f"{req.pool.name}/{req.replica}".encode()))
        if self._cfg.server.route_header:
            hdrs.append((b"x-kvgate-route", req.route.encode()))
        if req.extra:
            hdrs.extend(req.extra)
        return hdrs

    async def _relay(
        self, send: Send, req: ProxiedRequest, replica: Replica, resp: UpstreamResponse,
        lease: Lease,
    ) -> bool:
        """Send the upstream answer to the client; True when it was read to its end."""
        req.ctl.headers_received()
        if not (req.parsed.stream and resp.status == 200
                and resp.content_type.startswith("text/event-stream")):
            return await self._relay_whole(send, req, replica, resp, lease)
        req.status = 200
        req.sse = True
        await send({"type": "http.response.start", "status": 200,
                    "headers": self._headers(req, resp.content_type)})
        scanner = StreamScanner(req.strip)
        try:
            await self._pump(send, req, replica, resp, lease, scanner)
        except TRANSPORT_ERRORS:
            replica.record_failure(self._clock())
            req.ctl.done = True
            await send({"type": "http.response.body", "more_body": False,
                        "body": _stream_error("The upstream replica failed mid-stream.")})
            return False
        replica.record_success()
        if scanner.usage:
            req.usage = scanner.usage
            req.used = _total(scanner.usage)
            self._metrics.usage(req.pool.name, scanner.usage, req.tier)
        req.ctl.done = True
        await send({"type": "http.response.body", "body": scanner.flush(), "more_body": False})
        return True

    async def _pump(
        self, send: Send, req: ProxiedRequest, replica: Replica, resp: UpstreamResponse,
        lease: Lease, scanner: StreamScanner,
    ) -> None:
        """Relay chunks as they come. TTFT is taken when the first chunk carrying content
        reaches the client (not vLLM's role-only first chat chunk), inter-token latency is
        the gap between chunks sent after it, and kvgate's relay overhead (upstream chunk
        received -> handed to the client) is sampled on every `RELAY_SAMPLE`-th chunk."""
        ctl = req.ctl
        chunk = await resp.read_chunk()
        if chunk:  # the engine has answered the prompt (what the router learns from)
            lease.first_token()
            self._router.record_first_token(
                replica.id, req.features, perf_counter() - req.t0, self._clock())
        itl = self._metrics.itl_child(req.pool.name)
        n = 0
        last_sent = 0.0
        while chunk:
            received = perf_counter()
            ctl.touch()
            out = scanner.feed(chunk)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
                sent = perf_counter()
                if req.ttft is not None:
                    itl.observe(sent - last_sent)
                elif _CONTENT.search(out):
                    req.ttft = sent - req.t0
                    self._metrics.first_token(req.pool.name, req.ttft, req.tier)
                last_sent = sent
                if n % RELAY_SAMPLE == 0:
                    self._metrics.relay.observe(sent - received)
                n += 1
            chunk = await resp.read_chunk()

    async def _relay_whole(
        self, send: Send, req: ProxiedRequest, replica: Replica, resp: UpstreamResponse,
        lease: Lease,
    ) -> bool:
        try:
            data = await resp.read_all()
        except TRANSPORT_ERRORS:
            replica.record_failure(self._clock())
            raise UpstreamError("The replica failed while answering.") from None
        lease.first_token()
        if resp.status >= 500 and resp.status != 503:
            replica.record_failure(self._clock())
        else:
            replica.record_success()
        if resp.status == 200 and (usage := scan_usage(data[-1024:])):
            req.usage = usage
            req.used = _total(usage)
            self._metrics.usage(req.pool.name, usage, req.tier)
        req.status = resp.status
        req.ctl.done = True
        hdrs = self._headers(req, resp.content_type)
        hdrs.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": resp.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": data, "more_body": False})
        return True

    # -- endings -----------------------------------------------------------------------------
    async def _cancelled(self, send: Send, req: ProxiedRequest) -> None:
        if req.ctl.reason == "disconnect":
            req.status = 499  # nginx's "client closed request", for the metrics only
            return
        exc = UpstreamTimeout(f"The replica did not answer in time ({req.ctl.reason}).")
        if req.sse:
            await send({"type": "http.response.body", "more_body": False,
                        "body": _stream_error(exc.message)})
        else:
            await self._send_error(send, req, exc)

    async def _send_error(self, send: Send, req: ProxiedRequest, exc: KvgateError) -> None:
        req.status = exc.status
        hdrs = [*exc.headers(), *req.extra, (b"x-request-id", req.req_id)]
        await send({"type": "http.response.start", "status": exc.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": exc.body(), "more_body": False})


def _stream_error(message: str) -> bytes:
    """Close a broken stream: an error event, then [DONE]. An incomplete upstream event is
    never forwarded (the scanner holds fragments back), so it is simply dropped: a client
    must not be handed half a JSON object."""
    err = error_body(message, "BadGatewayError", 502)
    return b"data: " + err + b"\n\n" + DONE_EVENT


def _total(usage: dict[str, int]) -> int:
    return usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
