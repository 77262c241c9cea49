"""The answer side of an exchange: the replica's response headers, body and trailers in; the
answer the client gets out -- a stream's head held until its first bytes (its opening events
until its first output), whole answers held to their end and judged (module docstring of
`gateway.epp.exchange`)."""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.answer_headers import NO_RETRY, removed
from gateway.epp import envoy_reply, wire
from gateway.epp.deadlines import Deadlines
from gateway.epp.local_reply import local_error
from gateway.epp.modes import headers_skipped
from gateway.epp.state import replica_key
from gateway.errors import (
    REFUSED,
    AnswerTooLarge,
    KvgateError,
    ReplicaRefused,
    ReplicaWrongModel,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.request import ProxiedRequest
from gateway.responses import response_id
from gateway.sse import (
    StreamScanner,
    body_usage,
    carries_output,
    no_event,
    output_chars,
    preamble_only,
)
from gateway.stored import (
    NO_EVENTS,
    NOT_IN_TIME,
    UNANSWERED,
    not_a_stream,
)
from gateway.stream_end import (
    CUT_SHORT,
    NOT_STARTED,
    stream_error,
    stream_failure,
    unstarted_failure,
)
from gateway.upstream_errors import (
    ANSWERED_AN_ERROR,
    encoded,
    error_in_success,
    openai_shaped,
    unreadable,
)
from gateway.verdicts import (
    alone_with_error_event,
    busy_wait,
    engine_died,
    internal_error,
    judge,
    no_other_replica,
    not_an_answer,
    not_what_was_asked,
    relayed_retry_after,
    served,
)
from gateway.whole import CUT_ANSWER, cut_json, garbled, json_object, without_bom

__all__ = ["AnswerSide"]


class AnswerSide(Deadlines):
    """What the replica answered, relayed as the HTTP edge relays it."""

    __slots__ = ()

    async def _served_by(self, ep: str | None, status: int) -> None:
        """Envoy went past the first endpoint: the ones before the served one failed, unless
        its answer is vLLM's 500 for this request (`_answered_whole`: Envoy retries a 500, so
        they most likely failed it alike); a 503 is judged with its body (Envoy's own when its
        connection was refused too: `router_reset` asks them for one first)."""
        req = self.req
        assert req is not None
        rid = replica_key(ep) if ep else None
        if rid is None or rid == req.replica:
            return
        served = next((r for r in self.order if r.id == rid), None)
        if served is None:
            return  # not one of ours (a data plane that ignored the destination)
        self._skipped = self.order[:self.order.index(served)]
        for _ in self._skipped:  # Envoy's own retries, seen by the operator as the HTTP
            self._core.metrics.retried(req.pool_name, "envoy")  # edge's are (not why: unsaid)
        if status not in (500, 503):
            await self._charge_skipped()
        self._detach()
        self._attach(served)
        # the first-byte timeout is each try's, as at the HTTP edge: the served endpoint's
        # began at the latest now (its head held from the first try's send, a stream whose
        # first try Envoy cut at the first-byte timeout was the 504 with the retry's answer in)
        self._sent_at = perf_counter()
        req.route = "retry"
        if envoy_reply.maker(self._details, status, b"") == "replica":  # (not Envoy's answer
            self._core.metrics.failover(req.pool_name)  # for it: nothing succeeded there)

    # -- response path ---------------------------------------------------------------------
    async def response_headers(
        self, msg: pb.ProcessingRequest,
    ) -> Sequence[pb.ProcessingResponse]:
        req = self.req
        headers = msg.response_headers.headers.headers
        status, content_type = wire.status_of(headers)
        end = msg.response_headers.end_of_stream
        limit = self._core.cfg.upstream.max_answer_bytes
        sse = status == 200 and content_type.startswith("text/event-stream")
        self._details = wire.code_details(msg)
        self._removed = removed((h.key for h in headers),
                                wire.header_value(headers, "connection"))
        if self._local():
            if req is not None:
                req.status = status
                self._unasked()
            return ([wire.headers_response()] if status < 400
                    else await self._hold(status, headers, end))
        if req is None or self._lease is None:  # a stored response's answer, as the HTTP edge
            if self._stream and status == 200:  # a 200 that is not the stream asked for: 502
                if not sse:
                    return [self._refuse(not_a_stream(content_type))]
                self._scanner = StreamScanner(strip_usage=False, max_event_bytes=limit)
                return self._stream_head(self._stored_headers(), end)
            if 200 < status < 400:  # (vLLM answers 200 or an error: the HTTP edge's 502)
                return [self._refuse(not_an_answer(status))]
            return await self._hold(status, headers, end)
        await self._served_by(wire.served_endpoint(msg), status)
        req.status = status
        coding = wire.header_value(headers, "content-encoding")
        if coding is not None and coding.strip().lower() not in ("", "identity"):
            # compressed though the picker asked for identity: the HTTP edge's 502 (its
            # `H1Conn`), not "not JSON" or an empty stream, and a failure of the replica
            assert req.target is not None
            req.target.record_failure(self._core.clock())
            return [self._refuse(unreadable(encoded(coding.encode("latin-1"))))]
        stream = req.parsed.stream and req.kind != "embeddings"
        if 200 < status < 400 or (status == 200 and not (sse and stream) and (
                stream or not content_type.startswith("application/json"))):
            # a 204, a 202 page, a redirect, a 200 page or a whole answer to a stream: the
            # HTTP edge's 502 (`Relay`), and a failure of the replica
            assert req.target is not None
            req.target.record_failure(self._core.clock())
            return [self._refuse(not_an_answer(status) if status != 200
                                 else not_what_was_asked(stream, content_type))]
        if sse and req.parsed.stream:
            self._scanner = StreamScanner(req.strip, limit)
            self._want_id = req.kind == "responses"
            self._holds = self._want_id and req.parsed.data.get("background") is not True
            return self._stream_head(self._headers(), end)
        return await self._hold(status, headers, end)

    def _local(self) -> bool:
        """An answer now is Envoy's own or a filter's (a local reply), not a replica's: no
        request came this way (the stream's first message is the answer: an authorization
        filter's 401/403 before the picker's, a rate limit's 429, a health check's 200), or
        its body is still arriving (Envoy's stream idle timeout's 408). Passed on with its
        status, an error's body OpenAI-shaped, nothing judged. (It was read as a stored
        response's answer: a 401/403 became the 502 "The replica refused the gateway's
        credentials", a 200 page the 502 for an answer that is not JSON; or as the replica's
        answer to a request not sent yet: the picker failed, Envoy's 503 "The endpoint
        picker is unavailable".) Or Envoy says it is its own, made after the picker's answer
        but not by its router (`envoy_reply.local`: a filter after the picker's -- a rate
        limit's 429, an authorization filter's 403 --, a route to a cluster with no healthy
        endpoint's 503): no replica was asked. (It was judged as the replica's answer: a 403
        marked the replica down and was the 502 "The replica refused the gateway's
        credentials", a 429 backed it off, a 503 counted its failure until it was ejected.)"""
        return not self.begun or self._receiving() or envoy_reply.local(self._details)

    def _unasked(self) -> None:
        """No replica was asked: its lease is given back, nothing judged or learnt."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

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

    async def _hold(
        self, status: int, headers: Any, end: bool,
    ) -> Sequence[pb.ProcessingResponse]:
        """A whole answer (not a stream): held to its end and answered then (judged, an error
        re-shaped), at most `upstream.max_answer_bytes` of it, as `relay.read_whole` reads one
        on the HTTP edge: past the bound (declared in its head, or held) it is the 502
        `AnswerTooLarge`, not retried."""
        limit = self._core.cfg.upstream.max_answer_bytes
        if (declared := wire.declared_length(headers)) is not None and declared > limit:
            return [self._refuse(AnswerTooLarge(limit))]
        self._held, self._held_status = [], status
        self._held_type = wire.status_of(headers)[1]
        self._held_declared = declared is not None
        self._held_retry = wire.header_value(headers, "retry-after")
        self._last = perf_counter()  # its head: the answer has started (the idle timeout)
        return await self._whole_answer(headers_only=True) if end else []

    async def response_body(
        self, msg: pb.ProcessingRequest,
    ) -> Sequence[pb.ProcessingResponse]:
        body = msg.response_body
        chunk, end = body.body, body.end_of_stream
        self._last = perf_counter()  # (the idle timeout's clock)
        if self._lease is not None and self.req is not None and self.req.status == 0:
            headers_skipped()  # (no answer's head came: the filter skips them)
        if self.sse:
            return self._stream_chunk(chunk, end)
        if self._held is not None:
            self._held.append(chunk)
            self._held_bytes += len(chunk)
            limit = self._core.cfg.upstream.max_answer_bytes
            if self._held_bytes > limit:  # Envoy resets the replica's stream
                self._held = None
                return [self._refuse(AnswerTooLarge(limit))]
            return await self._whole_answer() if end else []
        return wire.body_responses(chunk, end)

    async def response_trailers(self) -> Sequence[pb.ProcessingResponse]:
        out: list[pb.ProcessingResponse] = []
        if self._head is not None:  # a stream that ended before its first event
            return [self._unstarted()]
        if self._held is not None:  # the body ended without an end-of-stream message
            out = [*await self._whole_answer(end=False)]
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
        return ([wire.headers_response(head, self._removed), *body] if head is not None
                else body)

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
        if out and not self._started and not no_event(out):
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
        if out and not no_event(out):
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
        # the client's answer is this one: the replica's rest is dropped, not judged again
        # (its end, read after an error event, counted the failure twice and made the
        # client's 502 the event's 500 in the metrics)
        self._cut = True
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
        if req.streamed is not None:  # (what it used, if no usage comes: `spent_tokens`)
            req.streamed += output_chars(out)

    def _stream_ended(
        self, scanner: StreamScanner, req: ProxiedRequest | None, whole: bool,
    ) -> None:
        if req is None:  # a stored response's stream: the HTTP edge does not judge it either
            return
        target = req.target
        assert target is not None
        now = self._core.clock()
        code = scanner.error_code
        if code is not None and alone_with_error_event(req.pool, target, scanner, now):
            target.count_failure()  # (the HTTP edge's rule: counted, not charged)
            req.status = code if whole else 502
        elif not whole:
            target.record_failure(now)
            req.status = 502
        elif code is not None and code >= 500:
            target.record_failure(now)  # the engine died mid-stream
            req.status = code
        else:
            served(target)
            self._core.streaks.served(target)

    async def _answered_whole(self, data: bytes) -> str | None:
        """A whole (non-streamed or error) answer arrived: judge it (the verdict), read its
        usage."""
        req, lease, core = self.req, self._lease, self._core
        assert req is not None and req.target is not None
        if lease is None or lease.answered:
            return None
        now = core.clock()
        lease.first_token()
        core.router.record_answered(req.replica, req.features, now)
        if internal_error(req.status, data) and (
                self._skipped or no_other_replica(req.pool, req.target, now)):
            # failed alike where Envoy tried it first, or no other replica could try it: the
            # request's fault as far as anything tells (the HTTP edge's rule), no replica's
            # unless one keeps failing so while others serve (`ErrorStreaks`); the only
            # replica's counted (`Replica.count_failure`)
            if not self._skipped:
                req.target.count_failure()
            else:
                for acquitted in (*self._skipped, req.target):
                    core.streaks.acquitted(acquitted, now)
            self._passed, self._skipped = self._skipped, []
            verdict = "request"
        else:
            await self._charge_skipped()
            verdict = judge(req.target, req.status, data, now, self._held_retry, req.pool)
            if verdict == "ok":
                core.streaks.served(req.target)
        if req.status == 200:
            self._usage(body_usage(data), req)
            if req.kind == "responses" and (rid := response_id(data)) is not None:
                core.responses.remember(rid, req.tenant_id, req.pool_name, req.replica)
        return verdict

    def _router_answered(self, made: envoy_reply.Maker) -> pb.ProcessingResponse:
        """Envoy's router answered for a stored response's replica (it sent no head): the
        HTTP edge's answers (`StoredResponses.whole`), not Envoy's 503 re-shaped as the
        replica's "The upstream replica answered 503." (a stored response's replica is not
        judged, as there)."""
        if made == "overflow":
            return self._overflow()
        if made == "timeout":
            return self._refuse(UpstreamTimeout(NOT_IN_TIME))
        return self._refuse(UpstreamError(UNANSWERED))

    def _usage(self, usage: dict[str, int] | None, req: ProxiedRequest) -> None:
        if usage:
            req.usage = usage
            req.used = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
            self._core.metrics.usage(req.pool_name, usage, req.tier)

    async def _whole_answer(
        self, *, end: bool = True, headers_only: bool = False,
    ) -> Sequence[pb.ProcessingResponse]:
        """The held whole answer (`headers_only`: one without a body), judged; an error
        OpenAI-shaped (Envoy's own replies are plain text). The replica's refusal of kvgate's
        credentials (401/403) and vLLM's 404 for a model it does not serve are the HTTP edge's
        502s (`ReplicaRefused`, `ReplicaWrongModel`: the replica is down, and neither status
        is the client's to see); a stored response's answer is not judged, as there."""
        req, status = self.req, self._held_status
        assert self._held is not None
        data, self._held = without_bom(b"".join(self._held)), None
        if status == 200 and (not json_object(self._held_type, data)  # an HTML page, a cut
                              or garbled(self._held_declared, data)):  # (or JSON that is not)
            if req is not None and req.target is not None:  # body: the HTTP edge's 502 and
                req.target.record_failure(self._core.clock())  # judgement (a stored one's:
            return [self._refuse(not_what_was_asked(False, self._held_type))]  # not judged)
        if status == 200 and ((cut := cut_json(self._held_declared, data)) or (
                said := error_in_success(data)) is not None):  # the HTTP edge's 502s too
            if req is not None and req.target is not None:
                req.target.record_failure(self._core.clock())
            return [self._refuse(UpstreamError(
                CUT_ANSWER, reason="cut") if cut else UpstreamError(
                f"{ANSWERED_AN_ERROR}{said}", reason="not_json"))]
        if self._local():  # a local reply's error: not judged (its request's id, if it came)
            headers, verdict = [("x-request-id", self._req_id)] if self._req_id else [], None
        elif req is None:
            if (made := envoy_reply.maker(self._details, status, data)) != "replica":
                return [self._router_answered(made)]
            headers = self._stored_headers()
            verdict = "refused" if status in REFUSED else None
        elif (made := envoy_reply.maker(self._details, status, data)) == "timeout":
            return [self.router_cut(req)]
        elif made != "replica":
            return [await self.router_reset(req, made)]
        else:
            verdict = await self._answered_whole(data)
            req.settled_headers()  # (settled at the exchange's close, with these tokens)
            headers = self._headers()
        if verdict == "refused":
            return [self._refuse(ReplicaRefused(status))]
        if verdict == "wrong_model":
            return [self._refuse(ReplicaWrongModel())]
        if verdict == "dead" and req is not None:  # the HTTP edge's answer (`relay.engine_died`)
            return [self._refuse(engine_died(req.pool, req.parsed.model, self._core.clock()))]
        gone = [*self._removed, "content-length"]  # (the body's length is Envoy's to say)
        if headers_only:
            return [wire.headers_response(headers, self._removed)]
        if status < 400:
            return [wire.headers_response(headers, gone), *wire.body_responses(data, end)]
        shaped = (local_error(status, data) if self._local()
                  else openai_shaped(status, data, req.path if req is not None else None))
        if shaped is not None:
            data = shaped
            headers.append(("content-type", b"application/json"))
        if status == 501 and req is not None:  # vLLM's NotImplementedError: the HTTP edge's
            headers.append((NO_RETRY[0].decode(), NO_RETRY[1]))  # hint (`relay`), the SDKs'
            # retries cannot outlast it
        busy = None  # (Envoy tries no other replica after a 429: this one's wait)
        if status == 429 and req is not None and req.target is not None:
            busy = busy_wait(req.target, self._held_retry, self._core.clock())
        if req is not None and (wait := relayed_retry_after(status, self._held_retry, busy)):
            headers.append(("retry-after", wait))  # the HTTP edge's rule (it sets the header)
        return [wire.headers_response(headers, gone), *wire.body_responses(data, end)]

