"""The answer side of an exchange: the replica's response headers, body and trailers in; the
answer the client gets out (module docstring of `gateway.epp.exchange`). This module reads
Envoy's messages and says who served (the endpoint Envoy used, the ones it went past); a
stream's answer is `stream_answer`'s, a whole one's `whole_answer`'s."""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.answer_headers import removed
from gateway.epp import envoy_reply, wire
from gateway.epp.modes import headers_skipped
from gateway.epp.state import replica_key
from gateway.epp.whole_answer import WholeAnswer
from gateway.errors import AnswerTooLarge
from gateway.sse import StreamScanner
from gateway.stored import not_a_stream
from gateway.upstream_errors import encoded, unreadable
from gateway.verdicts import not_an_answer, not_what_was_asked

__all__ = ["AnswerSide"]


class AnswerSide(WholeAnswer):
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

    async def response_body(
        self, msg: pb.ProcessingRequest,
    ) -> Sequence[pb.ProcessingResponse]:
        body = msg.response_body
        chunk, end = body.body, body.end_of_stream
        if (self._last == 0.0 and self._lease is not None and self.req is not None
                and self.req.status == 0):  # its first chunk, and no answer's head came: the
            self._core.misconfigured(*headers_skipped())  # filter skips them (once a request)
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
            return await self._whole_answer() if end else []
        return wire.body_responses(chunk, end)

    async def response_trailers(self) -> Sequence[pb.ProcessingResponse]:
        out: list[pb.ProcessingResponse] = []
        if self._head is not None:  # a stream that ended before its first event
            return [self._unstarted()]
        if self._held is not None:  # the body ended without an end-of-stream message
            out = [*await self._whole_answer(end=False)]
        return [*out, wire.trailers_response(request=False)]
