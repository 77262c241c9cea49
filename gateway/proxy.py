"""The hot path: one proxied OpenAI request, from body to relayed response.

Per request: authenticate (in memory), read the body (size-limited), then the step both
edges share (`prepare.py`: parse it once, admit it against the tenant's limits -- one store
round trip, none for a tenant without limits --, plan the pool from the principal's policy
snapshot, rewrite the body, ask the router), then try the decision's replica and its
fallbacks. The admission is settled with the real usage in a ``finally``. A connect error, a
reset, one of `upstream.retry_statuses` (500/502/503/504) or a 429 (not vLLM's: a limiter in
front of that replica) *before anything was sent to the client* (also an answer cut after
its headers, a 200 that is not JSON or not the stream asked for, a stream failing before its
first event: `Relay.relay`; a stream with no event within
the first-byte timeout, which is per try: `Canceller.retry_first_byte`) moves on to the next replica
(bounded by `max_attempts` and the pool's retry budget; a budget that runs out is a 503 with
Retry-After).
Once a streamed response has started, a failure ends it with an SSE error event and
``data: [DONE]``. Every lease on a replica's counters is released in a ``finally``; client
disconnects and timeouts cancel the handler task (see `Canceller`),
which closes the upstream connection so the replica aborts the generation. Relaying the answer
and judging the replica by it is `relay.py`; stored Responses-API responses (GET, cancel,
``previous_response_id``) are pinned to their replica (`responses.py`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Callable
from time import perf_counter

from gateway.anthropic_errors import ANTHROPIC_PATHS, anthropic_stream, error_body
from gateway.asgi import Receive, Scope, Send, send_whole
from gateway.config import KvgateConfig
from gateway.cors import Cors
from gateway.drain import SHUTDOWN, interruptible
from gateway.errors import (
    REFUSED,
    REQUEST_FAULT,
    AdapterGone,
    AnswerTooLarge,
    EncodedBody,
    FormBody,
    KvgateError,
    MultipartBody,
    ReplicaConnectionsBusy,
    ReplicaRefused,
    ReplicaWrongModel,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.flow import ClientWatch
from gateway.h1conn import UpstreamProtocolError
from gateway.httpguard import abort_client, refused_status
from gateway.metrics import GatewayMetrics
from gateway.multipart import FORM_KINDS, FORM_ROUTES, declared_form
from gateway.pool import Pool, Pools
from gateway.prepare import Preparer
from gateway.relay import Relay
from gateway.replicas import Replica
from gateway.request import Head, ProxiedRequest, Uploads, read_body, scan_headers
from gateway.responses import ReplicaSearch, ResponseStore
from gateway.retry_budget import budget_spent
from gateway.stored import StoredResponses
from gateway.stream_end import stream_error
from gateway.tenancy.edge import NO_AUTH_TENANT, TenantGate
from gateway.timeouts import Canceller, cut_error, stall_error
from gateway.transport import TRANSPORT_ERRORS, UpstreamResponse, connect_failure, refused
from gateway.upstream_errors import unreadable
from gateway.verdicts import busy_wait, internal_error, judge, no_other_replica
from gateway.vllm_routes import VLLM_KINDS
from gateway.whole import read_whole
from routing.router import Router
from routing.types import Decision

__all__ = ["KINDS", "MODELS", "MODEL_PREFIX", "Proxy"]

log = logging.getLogger(__name__)

# proxied route -> (kind, upstream path)
KINDS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "responses",
    **VLLM_KINDS,  # vLLM's own client routes (tokenize, rerank, Anthropic's messages, ...)
    **FORM_ROUTES,  # vLLM's audio routes (multipart/form-data bodies)
}
MODELS = "/v1/models"  # answered by kvgate itself, to a caller with a valid key
MODEL_PREFIX = MODELS + "/"  # `GET /v1/models/{model}` (a name may hold "/"), the same way
# failures answered as they are, even when the pool has no replica left: a misconfiguration
# (retrying cannot help: no "try again shortly") and a timeout (the client's 504)
_OWN_ANSWER = (ReplicaRefused, ReplicaWrongModel, UpstreamTimeout)
# the cuts of a try another replica may answer (`_attempt`): on the last try for the retry
# budget, or once its answer started to reach the client, a retry refused
_RETRIED_CUTS = frozenset({"first byte", "idle", "stall", "connection wait"})


class Proxy:
    def __init__(
        self, cfg: KvgateConfig, pools: Pools, router: Router, metrics: GatewayMetrics,
        clock: Callable[[], float], gate: TenantGate,
    ) -> None:
        self._cfg = cfg
        self._pools = pools
        self._gate = gate
        self._router = router
        self._metrics = metrics
        self._clock = clock
        self._limit = cfg.server.max_body_bytes
        self._uploads = Uploads(cfg.server.max_pending_body_bytes, cfg.server.max_body_bytes)
        self._up = cfg.upstream
        self._retry = frozenset([*cfg.upstream.retry_statuses, 429])
        self.cors = Cors.from_config(cfg.server)  # None: CORS off
        self.responses = ResponseStore()
        self.prep = Preparer(pools, router, metrics, clock, gate, self.responses,
                             cfg.flow.expected_output_tokens)
        self.planner = self.prep.planner
        self._relay = Relay(cfg, router, metrics, clock, self.responses,
                            self.prep.settle_before_answer)
        self.stored = StoredResponses(pools, gate, self.responses, cfg.upstream, cfg.server)
        if not gate.auth:  # one tenant: an id this gateway cannot place is asked of the replicas
            self.responses.finder = ReplicaSearch(
                pools, lambda: self.responses.owner(NO_AUTH_TENANT), cfg.health.timeout_s)
        # request ids: a random per-process prefix + a counter (unique, and cheaper than
        # reading the OS's random source per request)
        prefix = os.urandom(8).hex()
        counter = itertools.count()
        self._new_id: Callable[[], bytes] = lambda: f"{prefix}{next(counter):016x}".encode()

    # -- entry -------------------------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        head = scan_headers(scope["headers"], self._new_id)
        req = ProxiedRequest(path, KINDS[path], head.req_id, perf_counter(), head.up_id)
        if path in ANTHROPIC_PATHS:  # a stream kvgate ends: Anthropic's error event
            send = anthropic_stream(send)
        if head.origin is not None and self.cors is not None:
            req.cors = self.cors.allowed(head.origin) or ()
        try:
            try:
                decision, upstream_body = await self._admit_and_prepare(
                    req, scope, receive, head)
            except KvgateError as exc:
                await self._send_error(send, req, exc)
                return
            except asyncio.CancelledError:  # client disconnected before its body arrived, or
                req.status = refused_status(scope) or 499  # the HTTP guard answered it
                return
            await self._run(scope, send, receive, req, decision, upstream_body)
        finally:
            await self.prep.finish(req, log)

    async def handle_stored(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``GET /v1/responses/{id}`` (``?stream=true``: as a stream), ``POST
        /v1/responses/{id}/cancel``: to its replica."""
        head = scan_headers(scope["headers"], self._new_id)
        req_id, declared, token = head.req_id, head.declared, head.token
        if scope["method"] == "POST":  # a cancel takes no body: one is read (bounded, 413 past
            try:  # `server.max_body_bytes`, as any body, after the key's 401) and dropped
                self.prep.authenticate(token)
                await read_body(receive, self._limit, declared, self._uploads)
            except KvgateError as exc:
                await send_whole(send, exc.status, [*exc.headers(), (b"x-request-id", req_id)],
                                 exc.body())
                return
            except asyncio.CancelledError:
                return  # the client left while sending it
        await self.stored.handle(scope, receive, send, req_id, token)

    async def _run(
        self, scope: Scope, send: Send, receive: Receive, req: ProxiedRequest,
        decision: Decision, body: bytes,
    ) -> None:
        # (the parsed `stream`: a route that never streams, count_tokens, keeps a whole
        # answer's bounds whatever its body's field says, `vllm_routes.adapt`)
        req.ctl = Canceller(self._up, receive,
                            whole=not (req.features.stream and req.parsed.stream))
        try:
            with interruptible(req.ctl):  # ended cleanly at the end of the shutdown grace
                await self._forward(send, req, decision, body)
        except asyncio.CancelledError:
            if req.ctl.reason is None:
                raise  # shutdown or a real cancellation: not ours to swallow
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            await self._cancelled(scope, send, req)
        except KvgateError as exc:
            await self._send_error(send, req, exc)
        finally:
            req.ctl.close()
        if req.ctl.stalled:  # its stream's last piece was not taken (`Canceller.end`)
            self._stalled(scope, req)

    async def _admit_and_prepare(
        self, req: ProxiedRequest, scope: Scope, receive: Receive, head: Head
    ) -> tuple[Decision, bytes]:
        principal = self.prep.identify(req, head.token)  # before the body: no key, no upload
        if head.encoded:  # (its bytes would be judged "not JSON")
            raise EncodedBody
        if req.kind in FORM_KINDS:  # an audio upload: its form read (`gateway.multipart`)
            req.form = declared_form(scope["headers"])
        elif head.multipart:  # (likewise: "not valid JSON: no digit after sign")
            raise MultipartBody(req.path)
        # over a limit: no large upload
        await self.prep.before_body(req, principal, head.declared)
        body = await read_body(receive, self._limit, head.declared, self._uploads,
                               Uploads.owner(req))
        if head.form and req.form is None and body[:1].isalpha():  # (JSON routes) form fields
            raise FormBody(req.path)
        gone = ClientWatch(receive, scope)  # flow control drops a queued request then
        return await self.prep.prepare(req, principal, body, gone=gone)

    # -- attempts ----------------------------------------------------------------------------
    async def _forward(
        self, send: Send, req: ProxiedRequest, decision: Decision, body: bytes
    ) -> None:
        pool: Pool = req.pool
        # replicas that left the pool since the pick are skipped before counting attempts, so
        # `last` is really the last try (its error status then reaches the client as it is)
        found = (pool.by_id.get(rid) for rid in (decision.replica, *decision.fallbacks))
        order = [r for r in found if r is not None][: self._up.max_attempts]
        pool.budget.deposit()
        req.route = "spill" if req.spilled else decision.reason
        headers = {**pool.headers, "X-Request-Id": req.up_id.decode("latin-1")}
        if req.form is not None:  # (its boundary: the parts go on as they came)
            headers["Content-Type"] = req.form.content_type
        try:
            await self._tries(send, req, order, body, headers)
        finally:
            if req.suspect is not None:  # another replica answered it, or none could: the
                req.suspect.record_failure(self._clock())  # suspect's 500 was its own failure

    async def _tries(
        self, send: Send, req: ProxiedRequest, order: list[Replica], body: bytes,
        headers: dict[str, str],
    ) -> None:
        """The attempts. A replica's 500 for the request (`suspect`) whose other tries got no
        answer (a refused connection, a 503: nothing tells whose fault it was) is
        the client's answer, as the replica sent it -- more telling than the 502 for the
        other try's failure --, counted against it, not charged (as when no other replica
        can try it). A timeout's 504 and a misconfiguration's 502 stay the answer."""
        try:
            await self._try_each(send, req, order, body, headers)
        except KvgateError as exc:
            suspect = req.suspect
            if suspect is None or isinstance(exc, (*_OWN_ANSWER, AnswerTooLarge)) or (
                    isinstance(exc, UpstreamError) and exc.reason == "cut"):
                raise  # (an answer, if a broken or too large one: the picker's too)
            req.suspect = None
            suspect.count_failure()
            req.replica, req.target = suspect.id, suspect
            await self._relay.relay_held(send, req, 500, req.suspect_answer)

    async def _try_each(
        self, send: Send, req: ProxiedRequest, order: list[Replica], body: bytes,
        headers: dict[str, str],
    ) -> None:
        pool = req.pool
        failure: UpstreamError | None = None  # built only when an attempt fails (rare)
        rest = list(order)
        i = -1
        while rest:
            replica = rest.pop(0)
            i += 1
            if i > 0:
                if not pool.budget.try_spend():
                    self._metrics.retry_refused(pool.name, "budget")
                    # misconfigured, not busy: a "try again shortly" would only bring more of
                    # them; a timeout (other requests spent the budget while this one waited)
                    # stays the client's 504, not a 503 saying the replicas are busy
                    if isinstance(failure, ReplicaRefused | UpstreamTimeout):
                        raise failure
                    raise self._outage(req, failure) or budget_spent(failure)
                req.route = "retry"
                if failure is not None:  # (counted once the budget lets it go)
                    self._metrics.retried(pool.name, failure.reason)
            if i == 0:
                self._metrics.pre_upstream.observe(req.own_time(perf_counter()))
            spent = bool(rest) and pool.budget.tokens < 1.0  # the last try for the budget
            last = not rest or spent
            try:
                failure_or_none = await self._attempt(send, req, replica, body, headers, last)
            except UpstreamError as exc:  # the last try's failure, nothing sent yet
                if spent and exc.reason != REQUEST_FAULT:
                    self._metrics.retry_refused(pool.name, "budget")
                raise self._outage(req, exc) or exc from None
            except asyncio.CancelledError:  # a cut (first byte, stall) on the last try
                if spent and not req.relayed and req.ctl.reason in _RETRIED_CUTS:
                    self._metrics.retry_refused(pool.name, "budget")
                raise
            if failure_or_none is None:
                if spent and req.status in self._retry and not req.relayed:  # a replica's
                    # 5xx relayed whole as the last try's answer (a stream's: `started`)
                    self._metrics.retry_refused(pool.name, "budget")
                if i > 0:
                    self._metrics.failover(pool.name)
                return
            failure = failure_or_none
            # a fallback out of service since the pick (ejected, down, asleep: often found so
            # with this try's replica, a host or network both were on) is not tried: its
            # request would wait there, uncut (a cut comes when a replica is found out, not
            # after), until a timeout -- some 30 s more for a frozen one, minutes asleep
            now = self._clock()
            rest = [r for r in rest if r.available(now)]
            if self.prep.flow is not None:  # flow control: a retry only where there is room
                room = self.prep.flow.retry_to(pool.name, rest, now)
                if rest and not room and not isinstance(failure, _OWN_ANSWER):
                    self._metrics.retry_refused(pool.name, "flow")
                    raise self.prep.flow.retry_refused(pool.name, req.tier, req.tenant_id,
                                                       failure, now)
                rest = room
        failure = failure or UpstreamError("No replica answered.")
        raise self._outage(req, failure) or failure

    def _outage(self, req: ProxiedRequest, failure: UpstreamError | None) -> KvgateError | None:
        """The pool's 503 (why, Retry-After) when the tries found its replicas gone (refused
        connections, dead engines, ...) and none is left: the answer the next request gets,
        not a 502 or the last engine's 500 that only the first one of an outage sees. None:
        the failure is the answer (a timeout's 504, a misconfiguration's 502, or replicas
        remain)."""
        if failure is None or isinstance(failure, _OWN_ANSWER):
            return None
        now = self._clock()
        if req.pool.takes_requests(now):
            return None
        return req.pool.none_healthy(req.parsed.model, now)

    async def _attempt(
        self, send: Send, req: ProxiedRequest, replica: Replica, body: bytes,
        headers: dict[str, str], last: bool,
    ) -> UpstreamError | None:
        """One try on `replica`; returns an error to retry elsewhere, None when answered."""
        req.replica = replica.id
        req.target = replica
        first = req.attempts == 0
        lease = replica.acquire(req.features.prompt_tokens, req.features.stream, self._clock())
        lease.on_stall(req.ctl.replica_stalled)  # its engine stops, it is found down: elsewhere
        resp: UpstreamResponse | None = None
        clean = False
        try:
            req.ctl.attempt_started()
            self._router.record_route(replica.id, req.features, self._clock())
            if first:
                # one turn of the loop before the first try is sent: the disconnect watch
                # sees a client that left while the request waited (admission on a slow
                # Redis, flow control) and cancels it before a replica gets it -- on a
                # kept-alive connection the request was written before the watch ever ran,
                # and the replica aborted it only after (a prefill wasted). Taken after the
                # lease and the route: a request picked in this turn counts this one (before,
                # the requests read in one poll of the sockets all saw the replicas empty and
                # piled onto one)
                await asyncio.sleep(0)
            req.attempts += 1
            try:
                resp = await req.pool.transport.post(
                    replica.url + req.path, body, headers, req.ctl.sent)
            except TRANSPORT_ERRORS as exc:
                if refused(exc):  # nothing listens there: down now, not after N requests
                    replica.mark_down(self._clock(), gone=True)
                    why = replica.reason = connect_failure(exc, replica.url)
                else:
                    replica.record_failure(self._clock())
                    why = type(exc).__name__
                if isinstance(exc, UpstreamProtocolError):  # it answered, but not HTTP kvgate
                    # reads (gzip, a bad chunk size, a 1xx that never ends): said so
                    log.info("replica's answer not readable",
                             extra={"replica": replica.id, "reason": str(exc)})
                    return unreadable(str(exc))
                log.info("replica did not answer", extra={"replica": replica.id, "reason": why})
                return UpstreamError("The replica did not answer.", reason="connect")
            # a second internal error is relayed (`WholeRelay._relay_whole` acquits the suspect)
            retry = resp.status in self._retry and not last and not (
                resp.status == 500 and req.suspect is not None)
            if retry or resp.status in REFUSED:
                try:  # a short error body: it tells busy from faulted from dead
                    data = await read_whole(resp, self._up.max_answer_bytes)
                    clean = True
                except TRANSPORT_ERRORS:
                    data = b""
                except AnswerTooLarge:  # not a short error body: judged as a plain failure
                    data = b""
                if internal_error(resp.status, data):  # this replica's fault or the request's?
                    req.suspect = replica  # one other replica tries it and tells (`_forward`)
                    req.suspect_answer = data
                    log.info("replica answered 500, trying one other", extra={
                        "replica": replica.id, "request_id": req.req_id.decode("latin-1")})
                    return UpstreamError("The replica answered 500.", reason="status_500")
                now = self._clock()
                verdict = judge(replica, resp.status, data, now, resp.retry_after, req.pool)
                if verdict == "refused":  # kvgate's credentials, not the client's: a 502
                    return ReplicaRefused(resp.status)
                if resp.status == 429:  # the client's Retry-After if every try answers 429
                    wait = busy_wait(replica, resp.retry_after, now)
                    req.busy_wait = wait if req.busy_wait is None else min(wait, req.busy_wait)
                return UpstreamError(
                    f"The replica answered {resp.status}.",
                    reason="busy" if verdict == "busy" else f"status_{resp.status}",
                )
            try:
                clean = await self._relay.relay(send, req, replica, resp, lease)
            except UpstreamError as exc:  # it failed before any byte reached the client
                if last and isinstance(exc, AdapterGone):  # no try left: the replica's 404
                    await self._relay.relay_held(send, req, 404, exc.answer)
                    return None
                if last or exc.reason == REQUEST_FAULT:  # (`Relay.relay`): another replica
                    raise  # can still answer it, unless the request fails wherever it runs
                return exc
            return None
        except asyncio.CancelledError:
            if req.ctl.reason == "first byte" and replica.hung(
                    lease, self._router.ttft_fit(replica.id), self._up.first_byte_timeout_s):
                replica.record_failure(self._clock())  # judged while its lease still counts
            # a first-byte timeout cuts this try only: nothing reached the client, so another
            # replica may answer (the `finally` drops the connection: the replica aborts it)
            # (a wait for one of its connections is kvgate's own queue: not judged; a stall
            # was judged when it was found, `Replica.record_scrape`)
            cut = req.ctl.reason
            if last or req.relayed or not req.ctl.retry_first_byte():
                raise
            if cut == "connection wait":
                log.info("replica's connections all in use", extra={"replica": replica.id})
                return ReplicaConnectionsBusy()
            if cut == "stall":
                log.info("replica stalled: trying another", extra={"replica": replica.id})
                return stall_error()
            if cut == "idle":  # its answer began (a whole one's head), then stopped
                replica.record_failure(self._clock())
                log.info("replica's answer stopped: trying another", extra={"replica": replica.id})
                return UpstreamTimeout("The replica did not answer in time (idle timeout).",
                                       reason="idle")
            log.info("replica sent nothing in time", extra={"replica": replica.id})
            return UpstreamTimeout("The replica did not answer in time (first byte timeout).",
                                   reason="first_byte")
        finally:
            if not lease.answered:
                self._router.record_failure(replica.id, req.features, self._clock())
            lease.release()
            if resp is not None:
                resp.release() if clean else resp.abort()

    # -- endings -----------------------------------------------------------------------------
    async def _cancelled(self, scope: Scope, send: Send, req: ProxiedRequest) -> None:
        reason = req.ctl.reason
        if reason == "disconnect":
            # (an error event's code, or a stream relayed whole: it answered, `Relay.relay`)
            if not (req.sse and req.status >= 400) and not req.ctl.done:
                req.status = 499  # nginx's "client closed request", for the metrics only
            return
        if reason == "client":
            self._stalled(scope, req)
            return
        exc = cut_error(reason)
        if reason == SHUTDOWN:
            req.route = "interrupted"  # recorded as 503 / route "interrupted"
        target = req.target  # (a first-byte cut was judged by `_attempt`)
        if (req.relayed and reason in _RETRIED_CUTS and target is not None
                and not no_other_replica(req.pool, target, self._clock())):
            # a started stream cut: not retried, though another replica took requests
            self._metrics.retry_refused(req.pool.name, "started")
        if reason == "idle" and target is not None:
            target.record_failure(self._clock())  # a stalled answer: a passive signal
        if req.sse:
            req.status = exc.status
            if req.ctl.blocked:  # cut while the client was not taking a chunk: it is not
                return  # reading, so an error event would wait for it as long as it likes
            await self.prep.settle_before_answer(req)
            await req.ctl.end(send, stream_error(exc.message, exc.type_, exc.status))
        else:
            await self._send_error(send, req, exc)

    @staticmethod
    def _stalled(scope: Scope, req: ProxiedRequest) -> None:
        """The client stopped reading the stream (its socket full for `idle_timeout_s`): the
        replica is not at fault; the connection is reset."""
        abort_client(scope)
        req.status = 408
        log.info("client stopped reading the stream",
                 extra={"request_id": req.req_id.decode("latin-1")})

    async def _send_error(self, send: Send, req: ProxiedRequest, exc: KvgateError) -> None:
        req.status = exc.status
        # released before the answer goes out: a client's next request, the moment it has
        # this one's error, finds its tenant's concurrency lease back (`Relay._settle` alike)
        await self.prep.settle_before_answer(req)
        if req.sse:  # only keep-alive comments went out (`Relay._pump`): the stream is open
            await req.ctl.end(send, stream_error(exc.message, exc.type_, exc.status))
            return
        await send_whole(send, exc.status, [*exc.headers(), *req.extra, *req.cors,
                                            (b"x-request-id", req.req_id)],
                         error_body(req.path, exc))  # (Anthropic's shape on its routes)
