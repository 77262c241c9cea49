"""The whole answers of an exchange (`gateway.epp.answer_side`): an answer that is not a
stream -- a non-streamed completion, an error, a stored response's -- held to its end (at most
`upstream.max_answer_bytes`), judged as the HTTP edge judges it (a 200 that is no JSON object,
a replica's 401/403, vLLM's wrong-model 404 and dead-engine 500 the HTTP edge's answers; Envoy's
router's own answers for it told apart, `envoy_reply`), its usage read, an error OpenAI-shaped;
and the headers kvgate adds to an answer."""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.answer_headers import NO_RETRY
from gateway.epp import envoy_reply, wire
from gateway.epp.local_reply import local_error
from gateway.epp.stream_answer import StreamAnswer
from gateway.errors import (
    REFUSED,
    AnswerTooLarge,
    ReplicaRefused,
    ReplicaWrongModel,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.responses import response_id
from gateway.sse import body_usage
from gateway.stored import NOT_IN_TIME, UNANSWERED
from gateway.upstream_errors import ANSWERED_AN_ERROR, error_in_success, openai_shaped
from gateway.verdicts import (
    busy_wait,
    engine_died,
    internal_error,
    judge,
    no_other_replica,
    not_what_was_asked,
    relayed_retry_after,
)
from gateway.whole import CUT_ANSWER, cut_json, garbled, json_object, without_bom

__all__ = ["WholeAnswer"]


class WholeAnswer(StreamAnswer):
    """A whole answer, held, judged and relayed as the HTTP edge relays it."""

    __slots__ = ()

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
        shaped = (local_error(status, data, self._path) if self._local()
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
