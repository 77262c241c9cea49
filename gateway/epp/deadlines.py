"""The HTTP edge's upstream timeouts (`gateway/timeouts.py`) applied to an exchange's
answer by the picker, and its body timeout (`server.body_timeout_s`, `gateway/httpguard.py`)
to a request body still arriving: `server.py` waits for Envoy's next message until
`deadline`, then answers `timed_out`; and Envoy's router's own answers for a replica that
sent no head -- its timeout (`router_cut`), a connection refused or broken
(`router_reset`) -- answered as the HTTP edge answers them when no attempt is left."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from time import perf_counter

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.epp import wire
from gateway.epp.envoy_reply import Maker
from gateway.epp.passed import PROBE_S, mark_refused
from gateway.epp.state import ExchangeState
from gateway.errors import (
    BodyNotInTime,
    NoReplicaAvailable,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.replicas import Replica
from gateway.request import ProxiedRequest
from gateway.stored import NOT_IN_TIME
from gateway.stream_end import AFTER_DONE_S, stream_error
from gateway.timeouts import cut_error

log = logging.getLogger("gateway.epp")

# why nothing could be connected to a replica (`gateway.transport.connect_failure`; a health
# check's reason ends with it: "/health: cannot connect")
CANNOT_CONNECT = "cannot connect"

__all__ = ["Deadlines"]


class Deadlines(ExchangeState):
    """When the answer must have come on, and what the client gets when it has not."""

    __slots__ = ()

    def deadline(self) -> float | None:
        """Seconds until an answer the picker sees passes one of the HTTP edge's upstream
        timeouts (`gateway/timeouts.py`), else None (nothing to bound): a stream not started
        (its head held, or opened by keep-alive comments or a background response's opening
        events only, `_opened`) past `first_byte_timeout_s` from when the request went to its
        replica; a started stream's bytes, or a whole answer's once its head came (a proxied
        one's, a stored response's, or a stored stream's answered with a whole one), stopping
        for `idle_timeout_s` (`StoredResponses.whole` alike); any answer past
        `total_timeout_s` from the request's start; a stream past its last event
        (`_after_done`) waits `AFTER_DONE_S` for its end, as on the HTTP edge. An
        answer whose head never comes is not seen here (Envoy calls the response path with
        the head): Envoy's router timeouts bound it (`envoy_config`)."""
        if self._receiving():
            return max(0.0, self._t0 + self._core.cfg.server.body_timeout_s - perf_counter())
        up = self._core.cfg.upstream
        if self._cut or not self._sent_at or (self.req is not None and self._lease is None):
            return None
        total = self._t0 + up.total_timeout_s
        if self._unanswered():
            at = self._sent_at + up.first_byte_timeout_s
        elif self.sse or self._held is not None:  # (a stream past its last event: a moment)
            at = self._last + (AFTER_DONE_S if self._after_done() else up.idle_timeout_s)
        else:
            return None
        return max(0.0, min(at, total) - perf_counter())

    def _receiving(self) -> bool:
        """Its request's body is still arriving (a proxied one's, a stored response's
        cancel's)."""
        return self._pending is not None or (self.req is not None and not self._sent_at)

    def _unanswered(self) -> bool:
        """A stream whose answer has not started: the first-byte timeout bounds it."""
        return self._head is not None or (self.sse and not self._started)

    def _after_done(self) -> bool:
        """A stream past its last event (`StreamScanner.done`) whose body has not ended."""
        return self.sse and self._scanner is not None and self._scanner.done()

    def end_after_done(self) -> Sequence[pb.ProcessingResponse]:
        """Its end for the client (`Exchange.end_after_done`)."""
        raise NotImplementedError

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
        if self._receiving():
            return [self._refuse(BodyNotInTime("The request body did not arrive in time."))]
        req, up = self.req, self._core.cfg.upstream
        if self.deadline() is None:
            return ()
        if self._after_done():  # the HTTP edge's `next_chunk`: ended as it is, no 504 event
            return self.end_after_done()
        target = req.target if req is not None else None
        total = perf_counter() >= self._t0 + up.total_timeout_s
        first = self._unanswered()
        reason = "total" if total else "first byte" if first else "idle"
        self._cut = True
        if target is not None and reason == "first byte":
            self._first_byte_cut(target)
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
        return wire.body_responses(
            self._ending(stream_error(exc.message, exc.type_, exc.status)), True)

    def replica_stalled(self) -> Sequence[pb.ProcessingResponse]:
        """Its replica was found stalled (`gateway.stall`) or down by its health checks (a
        stopped process, a black-holed network) before the request got anything
        (`Lease.on_stall`, `ExchangeState._replica_cut`): ended now, as the HTTP edge ends
        its last try -- the 504 "The replica stopped making progress ..." (an immediate
        response: Envoy resets the replica's stream; its head held or not come yet), or the
        error event for a stream opened by keep-alive comments only. The picker cannot send
        the request again, and Envoy retries none of its answers; the SDKs retry a 504, and
        the next pick avoids the ejected replica. Nothing once the answer started (a first
        token, a whole answer's head: vLLM sends it with all of it), as on the HTTP edge.
        The replica was judged when it was found (ejected). Not when its connections are
        refused and the destination goes on past it: Envoy could not connect there either,
        so it went on to the next endpoint, which has the request (the served endpoint moves
        the lease when its head comes, `_served_by`) -- such a request was the 504 while the
        fallback was answering it."""
        req, lease = self.req, self._lease
        if (self._cut or req is None or lease is None or lease.answered
                or self._held is not None or self._moved_on(lease.replica)):
            return ()
        self._cut = True
        exc = cut_error("stall")
        log.info("replica stopped making progress: request ended",
                 extra={"replica": req.replica})
        if self._head is not None or not self.sse:  # no byte went to the client
            self._head = None
            return [self._refuse(exc)]
        req.status = exc.status  # opened by `: keep-alive` comments only
        return wire.body_responses(
            self._ending(stream_error(exc.message, exc.type_, exc.status)), True)

    def _moved_on(self, replica: Replica) -> bool:
        """Envoy went past `replica` to the next endpoint of the destination: nothing listens
        there (found so by a health check or a request: "cannot connect") and it is not the
        last endpoint."""
        return ((replica.reason or "").endswith(CANNOT_CONNECT) and replica in self.order
                and replica is not self.order[-1])

    async def _charge_skipped(self) -> None:
        """The endpoints Envoy went past failed: each is asked for a connection first
        (`passed.py`), marked down when it refuses it, as the HTTP edge marks down a replica
        whose connection is refused, else counted a failure (all were counted one failure
        only: a dead first choice was picked first again, and Envoy went past it again, until
        `health.failure_threshold` requests had paid for it or health polling found it)."""
        skipped, self._skipped = self._skipped, []
        down = await mark_refused(skipped, PROBE_S, self._core.clock)
        now = self._core.clock()
        for replica in skipped:
            if replica not in down:
                replica.record_failure(now)

    def _first_byte_cut(self, target: Replica) -> None:
        """A first-byte cut is the replica's failure only when nothing says it is working."""
        if self._lease is not None and target.hung(
                self._lease, self._core.router.ttft_fit(target.id),
                self._core.cfg.upstream.first_byte_timeout_s):
            target.record_failure(self._core.clock())

    def router_cut(self, req: ProxiedRequest) -> pb.ProcessingResponse:
        """Envoy's router cut a replica that sent no head (its 504, `envoy_reply.maker`;
        `envoy.py`: a stream's per-try idle timeout is the first-byte one, else the route's
        total one): no replica answered. The HTTP edge's 504 and judgement, as `timed_out`."""
        stream = req.parsed.stream and req.kind != "embeddings"
        if not stream or perf_counter() >= self._t0 + self._core.cfg.upstream.total_timeout_s:
            return self._refuse(cut_error("total"))
        if req.target is not None:
            self._first_byte_cut(req.target)
        return self._refuse(cut_error("first byte"))

    async def router_reset(self, req: ProxiedRequest, why: Maker) -> pb.ProcessingResponse:
        """Envoy's router could not connect to the replica, or lost it before its head (its
        503, `envoy_reply.maker`): no replica answered. Envoy's circuit breaker on the
        replicas' cluster (`overflow`) is not the replica's doing (`_overflow`). The HTTP
        edge's last try: a refused connection marks the replica down at once (nothing listens
        there), a broken one is a failure; so are the endpoints Envoy went past before it
        (`_charge_skipped`: Envoy says neither why it went past them, so each is asked for a
        connection) -- before, only the last one was marked down, so a pool whose replicas
        all died answered 502 "The replica did not answer." and picked the others again. The
        pool's 503 with Retry-After when no replica the request may use is left (the data
        plane's subset, else the pool: what the next request gets), else "The replica did not
        answer." (502)."""
        now, target = self._core.clock(), req.target
        if why == "overflow":  # Envoy's own limit: nothing reached the replica
            return self._overflow()
        if target is not None and why == "connect":
            target.mark_down(now, gone=True)
            target.reason = CANNOT_CONNECT
        elif target is not None:
            target.record_failure(now)
        await self._charge_skipped()
        now = self._core.clock()
        among = (None if self._subset is None
                 else [r for r in req.pool.replicas if r.id in self._subset])
        if not any(r.available(now) for r in (req.pool.replicas if among is None else among)):
            return self._refuse(req.pool.none_healthy(req.parsed.model, now, among))
        return self._refuse(UpstreamError("The replica did not answer.", reason="connect"))

    def _overflow(self) -> pb.ProcessingResponse:
        """Envoy refused to send the request (the replicas' cluster is at its circuit
        breaker's limit): a 503 with Retry-After, the replica neither judged nor charged --
        charged, every replica of a busy pool was ejected within a few overflows."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()
        return self._refuse(NoReplicaAvailable(
            "Envoy's limit on concurrent requests to the replicas (its circuit breaker) is "
            "reached; retry shortly."))
