"""One request's ext_proc stream: Envoy's messages in, the picker's answers out, in order.

Envoy runs the filter with request and response bodies in ``FULL_DUPLEX_STREAMED`` mode, so
the picker may hold its answers: it answers nothing to the request headers and body chunks
until the body is complete (at most ``server.max_body_bytes``; the bodies still arriving at
most ``server.max_pending_body_bytes`` together and half of it (or one whole body) for one
tenant, each ``server.body_timeout_s`` after its headers: 413, 503, 408 as at the HTTP
edge), then runs the step the HTTP proxy runs (`gateway.prepare.Preparer`: tenant,
admission, tier plan, body rewrite, pick)
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
an error event after them; no retry); a stream held open after its last event ends for the
client a moment later (`end_after_done`).
The lease is released and the admission settled when the answer's last message is answered
(the response body's end of stream, or its trailers) or when the stream ends first, however
it ends: closed, reset, its connection gone (`close`; `server.py` reads the rest of a stream
whose answer is over without answering it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.epp import wire
from gateway.epp.answer_side import AnswerSide
from gateway.epp.deadlines import Deadlines
from gateway.epp.passed import PROBE_S, SETTLE_S, mark_refused
from gateway.epp.request_side import RequestSide
from gateway.epp.state import PickerCore, endpoint, replica_key

log = logging.getLogger("gateway.epp")

__all__ = ["Exchange", "PickerCore", "endpoint", "replica_key"]


class Exchange(RequestSide, AnswerSide, Deadlines):
    """One ext_proc stream (one HTTP request through Envoy): its request side, its answer
    side, the upstream timeouts, and its end."""

    __slots__ = ()

    def end_after_done(self) -> Sequence[pb.ProcessingResponse]:
        """A stream held open `AFTER_DONE_S` after its last event: ended for the client now
        and judged whole, as the HTTP edge's `next_chunk` ends it (it waited for the idle
        timeout, then sent a 504 error event after the [DONE] and charged the replica)."""
        assert self._scanner is not None
        self._cut = True
        self._stream_ended(self._scanner, self.req, whole=True)
        return wire.body_responses(b"", True)

    async def close(self) -> None:
        """The stream ended (answered, refused, or cut): release, settle, count. Envoy ends
        a started stream's exchange before its end when the client leaves, or when the
        replica breaks the connection, which Envoy does not tell the picker: counted as the
        HTTP edge counts a client that left (499), the replica not judged by it -- unless the
        stream was already whole (a client that leaves at ``[DONE]`` may end the exchange
        before Envoy sends the stream's end), or the replica refuses a connection now (it
        died: marked down, counted 502; `passed.mark_refused`), or resets one taken within
        `SETTLE_S` (a connect that raced its exit: marked down once the request is settled,
        which a client that left is not kept waiting for)."""
        self._uploaded()  # a body cut or refused before its end
        req = self.req
        if req is None:
            return
        scanner = self._scanner
        broken = False  # its answer was cut: by the client, or by the replica
        if req.status == 0:
            req.status = 499  # the exchange ended before any answer (the client left)
        elif (self._lease is not None and not self._cut and self.sse and self._head is None
              and scanner is not None):  # started, not ended (it counted as 200)
            if scanner.complete():
                self._stream_ended(scanner, req, whole=True)
            else:
                req.status, broken = 499, True
        elif self._lease is not None and req.status == 200 and not self._lease.answered:
            # cut before it began (its head held): Envoy answered the client 502 itself when
            # the replica broke the connection
            req.status, broken = 502, True
        target = req.target if broken else None
        if target is not None and await mark_refused([target], PROBE_S, self._core.clock):
            # nothing listens at the replica's address any more: it died (a killed process),
            # so it cut the answer, not the client -- marked down now, as the HTTP edge marks
            # down a replica whose connection is refused (the next requests were sent to it
            # until health polling found it, each Envoy's 503: "The replica did not answer.")
            req.status, target = 502, None
        # Envoy went past them to an answer that was never judged (cut, too large, timed
        # out): they failed, as when it is judged (`_charge_skipped`)
        await self._charge_skipped()
        self._detach()
        await self._core.prep.finish(req, log)
        if target is not None:  # a connect may have raced its process's exit: watched once
            await mark_refused([target], PROBE_S, self._core.clock, SETTLE_S)  # settled
        if self._passed:
            await mark_refused(self._passed, self._core.cfg.upstream.connect_timeout_s,
                               self._core.clock)
