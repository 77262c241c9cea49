"""One request's ext_proc stream: Envoy's messages in, the picker's answers out, in order.

Envoy runs the filter with request and response bodies in ``FULL_DUPLEX_STREAMED`` mode, so
the picker may hold its answers: it answers nothing to the request headers and body chunks
until the body is complete (at most ``server.max_body_bytes``), then runs the step the HTTP
proxy runs (`gateway.prepare.Preparer`: tenant, admission, tier plan, body rewrite, pick)
and answers, in this order, the request headers (destination, new content length, the
pool's credentials instead of the client's) and the rewritten body in chunks. A request
kvgate refuses gets an immediate response in OpenAI's shape (401, 413, 429, 400, 404, 503).

A stored response's ``?stream=true`` takes the proxied streams' body path; its HEAD is the
HTTP edge's stream head (`StoredResponses.stream_head`).

The response passes through the picker too, which is how the router's state stays exact: the
endpoint that served (the lease moves there when Envoy fell back to another one), the first SSE
event that answers (what the router learns prefill speed from: not a keep-alive comment, nor a
Responses API stream's opening events, which vLLM sends before the prefill and the picker holds
until the first output, as the HTTP edge does, `_opened`), the usage chunk (stripped when
kvgate asked for it and the client did not), whole answers held to their end and judged as the
proxy judges them (a 502 past ``upstream.max_answer_bytes``, the stream scanner's bound per
event too; a replica's 401/403 and vLLM's wrong-model 404 the HTTP edge's 502s), and an error
answer's body re-shaped into OpenAI's when it is not (Envoy's own 503s are plain text). Envoy
sends the client nothing until the response headers are answered, so a stream's head is held
until its first bytes, as the HTTP edge sends it: a stream failing before them is the HTTP
edge's 502 JSON. A stored response's answers are bounded and held alike, not judged. The HTTP
edge's upstream timeouts apply once the answer's head is in, a stored response's too
(`deadline`, `timed_out`: the first-byte one until a stream's answer starts, the idle one after
it and after a whole answer's head; a 504 before a stream's first bytes and for a whole answer,
an error event after them; no retry).
The lease is released and the admission settled when the stream ends, however it ends
(`close`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.app import POSTED, unknown_path
from gateway.config import KvgateConfig
from gateway.epp import wire
from gateway.errors import (
    REFUSED,
    AnswerTooLarge,
    BodyTooLarge,
    KvgateError,
    MethodNotAllowed,
    NoReplicaAvailable,
    ReplicaRefused,
    ReplicaWrongModel,
    UpstreamError,
    UpstreamTimeout,
    openai_shaped,
)
from gateway.metrics import GatewayMetrics
from gateway.prepare import Preparer
from gateway.proxy import KINDS, MODEL_PREFIX, MODELS
from gateway.relay import (
    CUT_SHORT,
    NOT_STARTED,
    judge,
    served,
    stream_error,
    stream_failure,
    unstarted_failure,
)
from gateway.replicas import Lease, Replica
from gateway.request import ProxiedRequest, request_id
from gateway.responses import ResponseStore, response_id
from gateway.sse import (
    StreamScanner,
    body_usage,
    carries_output,
    comment_only,
    preamble_only,
)
from gateway.stored import (
    NO_EVENTS,
    NOT_IN_TIME,
    StoredResponses,
    match_stored,
    not_a_stream,
    wants_stream,
)
from gateway.tenancy.resolver import Principal, parse_bearer
from gateway.timeouts import cut_error
from routing.router import Router

__all__ = ["Exchange", "PickerCore", "endpoint", "replica_key"]

log = logging.getLogger("gateway.epp")
Page = tuple[int, list[tuple[bytes, bytes]], bytes]


@dataclass(frozen=True, slots=True)
class PickerCore:
    """What every exchange shares: the gateway's started core and the picker's settings."""

    cfg: KvgateConfig
    prep: Preparer
    router: Router
    metrics: GatewayMetrics
    responses: ResponseStore
    clock: Callable[[], float]
    # GET pages kvgate answers itself (/v1/models ...: for the caller, once authenticated)
    page: Callable[[str, Principal | None], Page | None]
    stored: StoredResponses  # where a stored Responses-API response lives
    new_id: Callable[[], bytes]
    fallbacks: int  # endpoints after the first in the destination (0: the first only)


def endpoint(replica: Replica) -> str:
    """The replica as the data plane names it: ``ip:port`` (``[v6]:port``)."""
    host, _, port = replica.id.rpartition(":")
    return f"[{host}]:{port}" if ":" in host else replica.id


def replica_key(ep: str) -> str:
    """An ``ip:port`` / ``[v6]:port`` endpoint as a replica id (``v6:port``)."""
    return ep.replace("[", "").replace("]", "") if ep.startswith("[") else ep


class Exchange:
    """The state of one ext_proc stream (one HTTP request through Envoy)."""

    __slots__ = ("_chunks", "_core", "_cut", "_head", "_held", "_held_bytes", "_held_status",
                 "_holds", "_last", "_lease", "_opening", "_pending", "_principal", "_req_id",
                 "_scanner", "_sent_at", "_size", "_started", "_stored", "_stream", "_subset",
                 "_t0", "_want_id", "order", "req", "sse")

    def __init__(self, core: PickerCore) -> None:
        self._core = core
        self.req: ProxiedRequest | None = None
        self._req_id = b""  # the answer's x-request-id (a stored response's: no `req`)
        self._principal: Principal | None = None
        self._subset: Collection[str] | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self.order: list[Replica] = []  # the destination: first choice, then fallbacks
        self._lease: Lease | None = None
        self.sse = False
        self._scanner: StreamScanner | None = None
        # a whole (non-SSE) answer, held to its end (`upstream.max_answer_bytes` at most) and
        # answered then: judged, read, an error re-shaped
        self._held: list[bytes] | None = None
        self._held_bytes = 0
        self._held_status = 0
        self._stored: str | None = None  # a stored response's pool/replica (not judged)
        self._stream = False  # a stored response's GET with ?stream=true: an SSE answer or 502
        # a stream's head (proxied or stored), held until its first bytes
        self._head: list[wire.Header] | None = None
        # a stream's answer has started (its first token; a stored one's: its first bytes):
        # the first-byte timeout applies until then, the idle one after
        self._started = False
        # a Responses API stream's opening events (`preamble_only`), held until its first
        # output when `_holds` (not a background response's), as the HTTP edge holds them
        self._holds = False
        self._opening = b""
        self._want_id = False  # a Responses API stream's id not remembered yet
        # a stored response's request with a body (a cancel's): its destination, answered with
        # the body once it is in (bounded), so no replica answers before a 413
        self._pending: pb.ProcessingResponse | None = None
        # the upstream timeouts (`deadline`): when the request went to its replica, when its
        # stream last sent bytes (perf_counter), and whether the picker ended it for them
        self._t0 = 0.0  # the request's start (the total timeout's), a stored one's too
        self._sent_at = 0.0  # when it went to its replica (0: not yet)
        self._last = 0.0
        self._cut = False

    @property
    def begun(self) -> bool:
        """Its request's headers have come (Envoy sends them once per stream)."""
        return self._t0 != 0.0

    # -- request path ----------------------------------------------------------------------
    async def request_headers(
        self, msg: pb.ProcessingRequest,
    ) -> Sequence[pb.ProcessingResponse]:
        """Who is asking and for what; nothing is answered before the body (unless refused)."""
        core = self._core
        self._t0 = perf_counter()
        path, query, method, token, sent_id, declared = _scan(msg.request_headers.headers.headers)
        kind = KINDS.get(path)
        if kind is None and match_stored(path):
            req_id = self._req_id = request_id(sent_id, core.new_id)
            if method == "HEAD":
                return [await self._head_stored(path, query, req_id, token)]
            if declared is not None and declared > core.cfg.server.max_body_bytes:
                try:  # a cancel's: bounded as any body, once the key is known good (401
                    core.prep.authenticate(token)  # first, as on the proxied routes)
                except KvgateError as exc:
                    return [self._refuse(exc)]
                return [self._refuse(self._too_large())]
            self._stream = wants_stream(query) and method == "GET"
            await self._core.stored.fetch(path, token)  # relayed by another gateway (Redis)
            out = self._to_stored(path, method, token)
            if msg.request_headers.end_of_stream or out.HasField("immediate_response"):
                return [out]
            self._pending = out
            return []
        if kind is None or method != "POST":
            return [self._not_proxied(path, method, token)]  # (no x-request-id, as there)
        req_id = self._req_id = request_id(sent_id, core.new_id)
        req = self.req = ProxiedRequest(path, kind, req_id, self._t0)
        hint = wire.subset_hint(msg)
        self._subset = frozenset(map(replica_key, hint)) if hint is not None else None
        try:
            self._principal = core.prep.identify(req, token)
            if declared is not None and declared > core.cfg.server.max_body_bytes:
                raise self._too_large()
            await core.prep.before_body(req, self._principal, declared)
        except KvgateError as exc:
            return [self._refuse(exc)]
        return []

    async def request_body(self, msg: pb.ProcessingRequest) -> Sequence[pb.ProcessingResponse]:
        body = msg.request_body
        self._size += len(body.body)
        if self._size > self._core.cfg.server.max_body_bytes:
            return [self._refuse(self._too_large())]
        if body.body:
            self._chunks.append(body.body)
        if not body.end_of_stream:
            return []
        return self._stored_body(end=True) or await self.decide(end=True)

    async def request_trailers(self) -> Sequence[pb.ProcessingResponse]:
        """Trailers end the body when they follow it (HTTP/2 clients may send them)."""
        out = self._stored_body(end=False)
        if not out and not self.order:
            out = list(await self.decide(end=False))
        if out and out[0].HasField("immediate_response"):
            return out
        return [*out, wire.trailers_response(request=True)]

    def _stored_body(self, *, end: bool) -> list[pb.ProcessingResponse]:
        """A stored response's request body is in: its destination, then the body as it
        came (vLLM's cancel ignores it)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        body, self._chunks = b"".join(self._chunks), []
        return [pending, *wire.body_responses(body, end, request=True)]

    async def decide(self, *, end: bool) -> Sequence[pb.ProcessingResponse]:
        """The body is complete: the shared step, then the destination and the new body."""
        req, principal = self.req, self._principal
        if req is None or principal is None or self.order:
            return []
        core = self._core
        body = b"".join(self._chunks)
        self._chunks = []
        try:
            decision, upstream = await core.prep.prepare(req, principal, body, self._subset)
            pool = req.pool
            picked = (decision.replica, *decision.fallbacks)[: 1 + core.fallbacks]
            self.order = [r for rid in picked if (r := pool.by_id.get(rid)) is not None]
            if not self.order:
                raise NoReplicaAvailable("The chosen replica left its pool; try again.")
        except KvgateError as exc:
            return [self._refuse(exc)]
        req.route = "spill" if req.spilled else decision.reason
        self._attach(self.order[0])
        self._sent_at = perf_counter()
        core.metrics.pre_upstream.observe(self._sent_at - req.t0)
        set_headers, remove = _credentials(pool.headers.get("Authorization"))
        # the body is JSON (parsed, rewritten): said so whatever the client declared (curl's
        # `-d` sends a form type), as the HTTP edge does; vLLM takes no other type
        set_headers += [("accept-encoding", b"identity"), ("x-request-id", req.req_id),
                        ("content-type", b"application/json")]
        destination = ",".join(endpoint(r) for r in self.order)
        return [wire.destination_response(destination, len(upstream), set_headers, remove),
                *wire.body_responses(upstream, end, request=True)]

    def _to_stored(self, path: str, method: str, token: str | None) -> pb.ProcessingResponse:
        """``GET /v1/responses/{id}``, ``POST .../cancel``: to the replica that holds it."""
        try:
            pool, replica = self._core.stored.locate(path, method, token, head=True)
        except KvgateError as exc:
            return self._refuse(exc)
        self._stored = f"{pool.name}/{replica.id}"
        self._sent_at = perf_counter()
        set_headers, remove = _credentials(pool.headers.get("Authorization"))
        set_headers.append(("x-request-id", self._req_id))  # the answer's, as the HTTP edge
        return wire.destination_response(endpoint(replica), None, set_headers, remove)

    async def _head_stored(
        self, path: str, query: bytes, req_id: bytes, token: str | None,
    ) -> pb.ProcessingResponse:
        """``HEAD /v1/responses/{id}``: GET without the body, as in the HTTP mode. vLLM has no
        HEAD routes (405), and Envoy's ext_proc may not change ``:method`` by default
        (`allow_all_routing`), so the picker asks the replica with GET itself and answers with
        that: Envoy sends a HEAD's local reply with the body's length and without the body.
        With ``?stream=true`` it is the stream's head, as the HTTP edge answers it (the
        replica's stream up to its first event, or the error before it)."""
        stored = self._core.stored
        try:
            if wants_stream(query):  # (the replica/route headers as configured)
                status, sent, body = await stored.stream_head(path, query, req_id, token)
            else:
                status, content_type, body, home = await stored.whole(
                    path, "HEAD", b"", token, req_id)
                sent = [(b"content-type", content_type.encode("latin-1")),
                        (b"x-request-id", req_id), *stored.where(home)]
        except KvgateError as exc:
            return self._refuse(exc)
        headers = [(k.decode(), v) for k, v in sent if k != b"content-length"]  # Envoy's
        return wire.immediate(status, body, headers, "kvgate_stored_head")

    def _not_proxied(self, path: str, method: str, token: str | None) -> pb.ProcessingResponse:
        """A route that is not proxied: kvgate's own pages, else OpenAI's 404/405."""
        if path in KINDS:
            return self._refuse(MethodNotAllowed(f"Use POST for {path}.", allow="POST"))
        # as the HTTP edge: GET and HEAD, and POST where vLLM takes it (`POST /ping`)
        get = method in ("GET", "HEAD") or (method == "POST" and path in POSTED)
        principal = None
        if get and (path == MODELS or (path.startswith(MODEL_PREFIX) and path != MODEL_PREFIX)):
            try:  # as the HTTP edge: a valid key, and the models of its tier
                principal = self._core.prep.authenticate(token)
            except KvgateError as exc:
                return self._refuse(exc)
        page = self._core.page(path, principal) if get else None
        if page is None and not get and self._core.page(path, None) is not None:
            allow = "GET, HEAD, POST" if path in POSTED else "GET, HEAD"
            return self._refuse(MethodNotAllowed(f"Use GET for {path}.", allow=allow))
        if page is None:
            return self._refuse(unknown_path(path))  # with a hint when /v1 is missing
        status, headers, body = page
        return wire.immediate(status, body, [(k.decode(), v) for k, v in headers], "kvgate_page")

    def _too_large(self) -> BodyTooLarge:
        limit = self._core.cfg.server.max_body_bytes
        return BodyTooLarge(f"The request body exceeds the limit of {limit} bytes.")

    def _refuse(self, exc: KvgateError) -> pb.ProcessingResponse:
        headers = [(k.decode(), v) for k, v in exc.headers()]
        if self.req is not None:
            self.req.status = exc.status
            headers += [(k.decode(), v) for k, v in self.req.extra]
        if self._req_id:  # a proxied or stored request's (not kvgate's own pages)
            headers.append(("x-request-id", self._req_id))
        return wire.immediate(exc.status, exc.body(), headers, f"kvgate_{exc.type_}")

    # -- the replica's lease ---------------------------------------------------------------
    def _attach(self, replica: Replica) -> None:
        req = self.req
        assert req is not None
        req.replica, req.target = replica.id, replica
        req.attempts += 1
        self._lease = replica.acquire(req.features.prompt_tokens)
        self._core.router.record_route(replica.id, req.features, self._core.clock())

    def _detach(self) -> None:
        """End the current lease; unanswered, it was a failure on that replica."""
        lease, req = self._lease, self.req
        if lease is None or req is None or req.target is None:
            return
        if not lease.answered:
            self._core.router.record_failure(req.target.id, req.features, self._core.clock())
        lease.release()
        self._lease = None

    def _served_by(self, ep: str | None) -> None:
        """Envoy went past the first endpoint: the ones before the served one failed."""
        req = self.req
        assert req is not None
        rid = replica_key(ep) if ep else None
        if rid is None or rid == req.replica:
            return
        served = next((r for r in self.order if r.id == rid), None)
        if served is None:
            return  # not one of ours (a data plane that ignored the destination)
        now = self._core.clock()
        for replica in self.order:
            if replica is served:
                break
            replica.record_failure(now)
        self._detach()
        self._attach(served)
        req.route = "retry"
        self._core.metrics.failover(req.pool_name)

    # -- response path ---------------------------------------------------------------------
    def response_headers(self, msg: pb.ProcessingRequest) -> Sequence[pb.ProcessingResponse]:
        req = self.req
        headers = msg.response_headers.headers.headers
        status, content_type = _status(headers)
        end = msg.response_headers.end_of_stream
        limit = self._core.cfg.upstream.max_answer_bytes
        sse = status == 200 and content_type.startswith("text/event-stream")
        if req is None or self._lease is None:  # a stored response's answer, as the HTTP edge
            if self._stream and status == 200:  # a 200 that is not the stream asked for: 502
                if not sse:
                    return [self._refuse(not_a_stream(content_type))]
                self._scanner = StreamScanner(strip_usage=False, max_event_bytes=limit)
                return self._stream_head(self._stored_headers(), end)
            return self._hold(status, headers, end)
        self._served_by(wire.served_endpoint(msg))
        req.status = status
        if sse and req.parsed.stream:
            self._scanner = StreamScanner(req.strip, limit)
            self._want_id = req.kind == "responses"
            self._holds = self._want_id and req.parsed.data.get("background") is not True
            return self._stream_head(self._headers(), end)
        return self._hold(status, headers, end)

    def _stream_head(
        self, head: list[wire.Header], end: bool,
    ) -> Sequence[pb.ProcessingResponse]:
        """A 200 event stream: its head goes out with its first bytes, as on the HTTP edge
        (`Relay`: vLLM sends the head before the prompt is scheduled). Envoy sends the
        client nothing until the headers are answered, so until then the picker can still
        answer a stream that fails first with the HTTP edge's 502 JSON (`_unstarted`)."""
        self.sse = True
        self._head = head
        return [self._unstarted()] if end else []

    def _hold(
        self, status: int, headers: Any, end: bool,
    ) -> Sequence[pb.ProcessingResponse]:
        """A whole answer (not a stream): held to its end and answered then (judged, an error
        re-shaped), at most `upstream.max_answer_bytes` of it, as `relay.read_whole` reads one
        on the HTTP edge: past the bound (declared in its head, or held) it is the 502
        `AnswerTooLarge`, not retried."""
        limit = self._core.cfg.upstream.max_answer_bytes
        if (declared := _length(headers)) is not None and declared > limit:
            return [self._refuse(AnswerTooLarge(limit))]
        self._held, self._held_status = [], status
        self._last = perf_counter()  # its head: the answer has started (the idle timeout)
        return self._whole_answer(headers_only=True) if end else []

    def response_body(self, msg: pb.ProcessingRequest) -> Sequence[pb.ProcessingResponse]:
        body = msg.response_body
        chunk, end = body.body, body.end_of_stream
        self._last = perf_counter()  # (the idle timeout's clock)
        if self.sse:
            return self._stream_chunk(chunk, end)
        if self._held is not None:
            self._held.append(chunk)
            self._held_bytes += len(chunk)
            limit = self._core.cfg.upstream.max_answer_bytes
            if self._held_bytes > limit:  # Envoy resets the replica's stream
                self._held = None
                return [self._refuse(AnswerTooLarge(limit))]
            return self._whole_answer() if end else []
        return wire.body_responses(chunk, end)

    def response_trailers(self) -> Sequence[pb.ProcessingResponse]:
        out: list[pb.ProcessingResponse] = []
        if self._head is not None:  # a stream that ended before its first event
            return [self._unstarted()]
        if self._held is not None:  # the body ended without an end-of-stream message
            out = [*self._whole_answer(end=False)]
        return [*out, wire.trailers_response(request=False)]

    def _stored_headers(self) -> list[wire.Header]:
        """The HTTP edge's headers of a stored answer: ``x-request-id``, the replica/route
        headers (`StoredResponses.where`)."""
        out: list[wire.Header] = [("x-request-id", self._req_id)]
        if self._stored is not None:
            out.extend((k.decode(), v) for k, v in self._core.stored.where(self._stored))
        return out

    def _headers(self) -> list[wire.Header]:
        req, server = self.req, self._core.cfg.server
        assert req is not None
        out: list[wire.Header] = [("x-request-id", req.req_id)]
        if server.replica_header:
            out.append(("x-kvgate-replica", f"{req.pool_name}/{req.replica}".encode()))
        if server.route_header:
            out.append(("x-kvgate-route", req.route.encode()))
        out.extend((k.decode(), v) for k, v in req.extra)
        return out

    def _stream_chunk(self, chunk: bytes, end: bool) -> Sequence[pb.ProcessingResponse]:
        """A streamed answer's chunk: a proxied stream (`req`), or a stored response's (no
        `req`: nothing to learn or judge); the head goes out with the first bytes."""
        scanner, req = self._scanner, self.req
        assert scanner is not None
        if scanner.malformed or self._cut:  # the client's stream has ended: the replica's
            return ()  # rest is dropped
        out = scanner.feed(chunk) if chunk else b""
        head = self._head
        if head is not None:  # nothing went out yet: a failure is a JSON error, as the HTTP
            limit = self._core.cfg.upstream.max_answer_bytes  # edge's (`unstarted_failure`)
            failure = unstarted_failure(scanner, limit, error_events=req is not None)
            if failure is not None:
                return [self._unstarted(failure)]
        out = self._opened(out, end)
        if head is not None:
            if not out:
                return [self._unstarted()] if end else ()
            if req is not None:
                req.sse = True  # the head goes out with these bytes
        self._head = None
        if scanner.malformed:
            # an event that is neither JSON nor [DONE] (or larger than the bound): never
            # forwarded, and the stream ends for the client at once, as a cut one does (the
            # headers are out: no retry here), not when the replica's does
            end = self._cut = True
            failure = stream_failure(scanner, self._core.cfg.upstream.max_answer_bytes)
            out += stream_error(failure.message)
            self._stream_ended(scanner, req, whole=False)
        elif end:
            self._cut = True  # ended: nothing to bound any more
            whole = scanner.complete()  # else cut short: an error event, never half an event
            rest = scanner.flush()
            out += rest if whole else stream_error(CUT_SHORT if self._started else NOT_STARTED)
            self._stream_ended(scanner, req, whole)
        if req is not None and scanner.usage is not None and req.usage is None:
            # as soon as it is seen: a client that leaves at [DONE] may end the exchange
            # before Envoy sends the end of the stream
            self._usage(scanner.usage, req)
        body = wire.body_responses(out, end) if out or end else []
        return [wire.headers_response(head), *body] if head is not None else body

    def _opened(self, out: bytes, end: bool) -> bytes:
        """What of a stream's new whole events goes out now. Its answer starts with its first
        event (a stored one's: its first bytes) that is neither a keep-alive comment nor one
        of a Responses API stream's opening events (`preamble_only`: vLLM sends them before
        the prefill): the first token the router learns from, the end of the first-byte
        timeout. The opening events are held until then and go out with it (`_holds`, as on
        the HTTP edge: a replica that hangs after them is the first-byte timeout's 504 JSON,
        not a started stream), or with the stream's end when it ends whole; a background
        response's go out as they come (the replica runs it on anyway)."""
        req, lease = self.req, self._lease
        if req is None or lease is None:  # a stored response's stream
            self._started = self._started or bool(out)
            return out
        if out and not self._started and not (out[:1] == b":" and comment_only(out)):
            if not (self._want_id and preamble_only(out)):
                self._started = True
                lease.first_token()
                self._core.router.record_first_token(
                    req.replica, req.features, perf_counter() - req.t0, self._core.clock())
            elif self._holds:
                self._opening, out = self._opening + out, b""
        if self._opening and (self._started or end):
            assert self._scanner is not None  # (a stream never complete: they are dropped)
            held, self._opening = self._opening, b""
            out = held + out if self._started or self._scanner.complete() else out
        if out and not (out[:1] == b":" and comment_only(out)):
            self._event(out, req)
        return out

    def _unstarted(self, failure: KvgateError | None = None) -> pb.ProcessingResponse:
        """A stream that failed before its first bytes went out (its head held): the HTTP
        edge's 502 JSON instead of a 200 -- `failure` (`unstarted_failure`: a first read with
        an event past the bound or not JSON, or vLLM's error event of code >= 500), else the
        stream that ended without an event -- judged as there (a failure, except the size:
        another replica's answer would be as large). The events read before it are dropped,
        as the HTTP edge never sends them."""
        scanner, req = self._scanner, self.req
        assert scanner is not None
        self._head = None
        if failure is None:
            failure = UpstreamError(NO_EVENTS if req is None else NOT_STARTED)
        if not scanner.oversized:
            self._stream_ended(scanner, req, whole=False)
        return self._refuse(failure)

    def _event(self, out: bytes, req: ProxiedRequest) -> None:
        """SSE events go out: a Responses API stream's id is remembered (follow-ups find its
        replica); the first event carrying generated output is the TTFT."""
        core = self._core
        if self._want_id and (rid := response_id(out)) is not None:
            self._want_id = False
            core.responses.remember(rid, req.tenant_id, req.pool_name, req.replica)
        if req.ttft is None and carries_output(out):
            req.ttft = perf_counter() - req.t0
            core.metrics.first_token(req.pool_name, req.ttft, req.tier)

    def _stream_ended(
        self, scanner: StreamScanner, req: ProxiedRequest | None, whole: bool,
    ) -> None:
        if req is None:  # a stored response's stream: the HTTP edge does not judge it either
            return
        target = req.target
        assert target is not None
        if not whole:
            target.record_failure(self._core.clock())
            req.status = 502
        elif scanner.error_code is not None and scanner.error_code >= 500:
            target.record_failure(self._core.clock())  # the engine died mid-stream
            req.status = scanner.error_code
        else:
            served(target)

    def _answered_whole(self, data: bytes) -> str | None:
        """A whole (non-streamed or error) answer arrived: judge it (the verdict), read its
        usage."""
        req, lease, core = self.req, self._lease, self._core
        assert req is not None and req.target is not None
        if lease is None or lease.answered:
            return None
        now = core.clock()
        lease.first_token()
        core.router.record_answered(req.replica, req.features, now)
        verdict = judge(req.target, req.status, data, now)
        if req.status == 200:
            self._usage(body_usage(data), req)
            if req.kind == "responses" and (rid := response_id(data)) is not None:
                core.responses.remember(rid, req.tenant_id, req.pool_name, req.replica)
        return verdict

    def _usage(self, usage: dict[str, int] | None, req: ProxiedRequest) -> None:
        if usage:
            req.usage = usage
            req.used = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
            self._core.metrics.usage(req.pool_name, usage, req.tier)

    def _whole_answer(
        self, *, end: bool = True, headers_only: bool = False,
    ) -> Sequence[pb.ProcessingResponse]:
        """The held whole answer (`headers_only`: one without a body), judged; an error
        OpenAI-shaped (Envoy's own replies are plain text). The replica's refusal of kvgate's
        credentials (401/403) and vLLM's 404 for a model it does not serve are the HTTP edge's
        502s (`ReplicaRefused`, `ReplicaWrongModel`: the replica is down, and neither status
        is the client's to see); a stored response's answer is not judged, as there."""
        req, status = self.req, self._held_status
        assert self._held is not None
        data, self._held = b"".join(self._held), None
        if req is None:
            headers = self._stored_headers()
            verdict = "refused" if status in REFUSED else None
        else:
            verdict = self._answered_whole(data)
            headers = self._headers()
        if verdict == "refused":
            return [self._refuse(ReplicaRefused(status))]
        if verdict == "wrong_model":
            return [self._refuse(ReplicaWrongModel())]
        if headers_only:
            return [wire.headers_response(headers)]
        if status < 400:
            return [wire.headers_response(headers), *wire.body_responses(data, end)]
        shaped = openai_shaped(status, data)
        if shaped is not None:
            data = shaped
            headers.append(("content-type", b"application/json"))
        if status == 503 and req is not None:
            headers.append(("retry-after", b"1"))
        return [wire.headers_response(headers, ("content-length",)),
                *wire.body_responses(data, end)]

    # -- the upstream timeouts --------------------------------------------------------------
    def deadline(self) -> float | None:
        """Seconds until an answer the picker sees passes one of the HTTP edge's upstream
        timeouts (`gateway/timeouts.py`), else None (nothing to bound): a stream not started
        (its head held, or opened by keep-alive comments or a background response's opening
        events only, `_opened`) past `first_byte_timeout_s` from when the request went to its
        replica; a started stream's bytes, or a whole answer's once its head came (a proxied
        one's, or a stored stream's answered with a whole one), stopping for `idle_timeout_s`;
        any answer past `total_timeout_s` from the request's start; a stored response's whole
        answer past the first of the first-byte and total ones (`StoredResponses.whole`). An
        answer whose head never comes is not seen here (Envoy calls the response path with
        the head): Envoy's router timeouts bound it (`envoy_config`)."""
        up = self._core.cfg.upstream
        if self._cut or not self._sent_at or (self.req is not None and self._lease is None):
            return None
        total = self._t0 + up.total_timeout_s
        if self._unanswered():
            at = self._sent_at + up.first_byte_timeout_s
        elif self.sse or (self._held is not None and not self._whole_stored()):
            at = self._last + up.idle_timeout_s
        elif self._held is not None:
            at = self._sent_at + up.first_byte_timeout_s
        else:
            return None
        return max(0.0, min(at, total) - perf_counter())

    def _unanswered(self) -> bool:
        """A stream whose answer has not started: the first-byte timeout bounds it."""
        return self._head is not None or (self.sse and not self._started)

    def _whole_stored(self) -> bool:
        """A stored response's GET (not a stream's), HEAD or cancel: bounded whole."""
        return self.req is None and not self._stream

    def timed_out(self) -> Sequence[pb.ProcessingResponse]:
        """`deadline` passed: what the HTTP edge answers for the cut -- its 504 JSON before a
        stream's first bytes or for a whole answer (an immediate response: Envoy drops the
        replica's stream), an error event ending a started stream -- and a proxied answer's
        replica judged as there (a first-byte cut is its failure only when nothing says it is
        working, `Replica.hung`; an idle answer is; the total timeout is not; a stored
        response's answer is not judged). The picker cannot send the request again: no other
        replica is tried."""
        req, up = self.req, self._core.cfg.upstream
        if self.deadline() is None:
            return ()
        target = req.target if req is not None else None
        total = perf_counter() >= self._t0 + up.total_timeout_s
        first = self._unanswered()
        reason = "total" if total else "first byte" if first else "idle"
        self._cut = True
        if target is not None and reason == "first byte" and self._lease is not None:
            if target.hung(self._lease, self._core.router.ttft_fit(target.id),
                           up.first_byte_timeout_s):
                target.record_failure(self._core.clock())
        elif target is not None and reason == "idle":
            target.record_failure(self._core.clock())  # a stalled answer: a passive signal
        if self._head is not None:
            self._head = None
            log.info("replica sent nothing in time",
                     extra={"replica": target.id if target is not None else self._stored})
            return [self._refuse(cut_error(reason))]
        if self._held is not None:
            late = UpstreamTimeout(NOT_IN_TIME) if self._whole_stored() else cut_error(reason)
            self._held = None
            return [self._refuse(late)]
        exc = cut_error(reason)
        if req is not None:
            req.status = exc.status
        return wire.body_responses(stream_error(exc.message, exc.type_, exc.status), True)

    # -- the end ---------------------------------------------------------------------------
    async def close(self) -> None:
        """The stream ended (answered, refused, or cut): release, settle, count. Envoy ends
        a started stream's exchange before its end when the client leaves, or when the
        replica breaks the connection, which Envoy does not tell the picker: counted as the
        HTTP edge counts a client that left (499), the replica not judged by it (health
        polling finds a dead one) -- unless the stream was already whole (a client that
        leaves at ``[DONE]`` may end the exchange before Envoy sends the stream's end)."""
        req = self.req
        if req is None:
            return
        scanner = self._scanner
        if req.status == 0:
            req.status = 499  # the exchange ended before any answer (the client left)
        elif (self._lease is not None and not self._cut and self.sse and self._head is None
              and scanner is not None):  # started, not ended (it counted as 200)
            if scanner.complete():
                self._stream_ended(scanner, req, whole=True)
            else:
                req.status = 499
        elif self._lease is not None and req.status == 200 and not self._lease.answered:
            # cut before it began (its head held): Envoy answered the client 502 itself when
            # the replica broke the connection
            req.status = 502
        self._detach()
        await self._core.prep.finish(req, log)


def _credentials(creds: str | None) -> tuple[list[wire.Header], tuple[str, ...]]:
    """The pool's vLLM key replaces the client's (which never reaches a replica)."""
    if creds:
        return [("authorization", creds.encode())], ()
    return [], ("authorization",)


def _scan(headers: Any) -> tuple[str, bytes, str, str | None, bytes, int | None]:
    """:path (no query), the query, :method, the bearer token, x-request-id, content-length."""
    path, query, method, token, req_id, declared = "", b"", "", None, b"", None
    for h in headers:
        key = h.key
        if key == ":path":
            raw, _, query = h.raw_value.partition(b"?")
            path = raw.decode("latin-1")
        elif key == ":method":
            method = h.raw_value.decode("latin-1")
        elif key == "authorization":
            token = parse_bearer(h.raw_value.decode("latin-1"))
        elif key == "x-request-id":
            req_id = h.raw_value
        elif key == "content-length" and h.raw_value.isdigit():
            declared = int(h.raw_value)
    return path, query, method, token, req_id, declared


def _length(headers: Any) -> int | None:
    """The declared content-length, if any."""
    for h in headers:
        if h.key == "content-length" and h.raw_value.isdigit():
            return int(h.raw_value)
    return None


def _status(headers: Any) -> tuple[int, str]:
    status, content_type = 0, ""
    for h in headers:
        if h.key == ":status":
            status = int(h.raw_value) if h.raw_value.isdigit() else 0
        elif h.key == "content-type":
            content_type = h.raw_value.decode("latin-1")
    return status, content_type
