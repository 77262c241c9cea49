"""The stream side of an exchange's answer (`gateway.epp.answer_side`): a 200 event stream's
head held until its first bytes (a Responses API stream's opening events until its first
output), then its events scanned as the HTTP edge scans them -- the first token learnt, the
usage read (and removed when only kvgate asked for it), a stream that fails before its first
event the HTTP edge's 502 JSON, one cut short or malformed ended with its error event -- and
the replica judged by how the stream ended."""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.epp import wire
from gateway.epp.deadlines import Deadlines
from gateway.errors import KvgateError, UpstreamError
from gateway.request import ProxiedRequest
from gateway.responses import response_id
from gateway.sse import StreamScanner, carries_output, no_event, output_chars, preamble_only
from gateway.stored import NO_EVENTS
from gateway.stream_end import (
    CUT_SHORT,
    NOT_STARTED,
    stream_error,
    stream_failure,
    unstarted_failure,
)
from gateway.verdicts import alone_with_error_event, served

__all__ = ["StreamAnswer"]


class StreamAnswer(Deadlines):
    """A streamed answer, proxied or stored, relayed as the HTTP edge relays it."""

    __slots__ = ()

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
        body = wire.body_responses(self._ending(out), end) if out or end else []
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

    def _usage(self, usage: dict[str, int] | None, req: ProxiedRequest) -> None:
        if usage:
            req.usage = usage
            req.used = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
            self._core.metrics.usage(req.pool_name, usage, req.tier)
