"""Relaying one upstream answer to the client.

Split from `proxy.py` (which keeps the request's steps and the attempts); how a broken stream
ends is `stream_end.py`; what the answer says about its replica (`judge` and the rules both
edges share) is `verdicts.py`. A stream is passed through as bytes (`StreamScanner` reads the
usage chunk and notes error events); a whole answer, and the head of any, is `relay_whole.py`'s
(`WholeRelay`, this class's base).

TTFT is taken when the first chunk carrying generated output reaches the client; ``: keep-alive``
comment lines (``--sse-keep-alive-interval``), blank lines and fields without data (``event:
ping``, ``retry: 3000``, ``id: 7``: a proxy's) are neither the first token nor an inter-token
gap: the client's SSE parser dispatches no event for them.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from time import perf_counter

from gateway.asgi import Send
from gateway.errors import UpstreamError
from gateway.relay_whole import WholeRelay, stored_by_replica, total_tokens
from gateway.replicas import Lease, Replica
from gateway.request import ProxiedRequest
from gateway.responses import response_id
from gateway.sse import (
    StreamScanner,
    carries_output,
    no_event,
    output_chars,
    preamble_only,
)
from gateway.stream_end import (
    ended_early,
    next_chunk,
    stream_error,
    stream_failure,
    unstarted_failure,
)
from gateway.transport import TRANSPORT_ERRORS, UpstreamResponse
from gateway.verdicts import (
    alone_with_error_event,
    dead_event,
    no_other_replica,
    served,
)

__all__ = ["Relay"]

log = logging.getLogger(__name__)

RELAY_SAMPLE = 16  # time the relay of one streamed chunk in this many (and the first)


class Relay(WholeRelay):
    """A stream relayed as it comes (`relay`); a whole answer: `WholeRelay`."""

    async def relay(
        self, send: Send, req: ProxiedRequest, replica: Replica, resp: UpstreamResponse,
        lease: Lease,
    ) -> bool:
        """Send the upstream answer to the client; True when it was read to its end. An
        `UpstreamError` means nothing was sent: the replica failed before its answer started
        (a whole answer cut, not JSON; a stream reset, empty or an error before its first
        event), and another replica may answer instead."""
        if not (req.parsed.stream and resp.status == 200
                and resp.content_type.startswith("text/event-stream")):
            return await self._relay_whole(send, req, replica, resp, lease)
        req.status = 200
        scanner = StreamScanner(req.strip, self._cfg.upstream.max_answer_bytes)
        try:
            held = await self._pump(send, req, replica, resp, lease, scanner)
        except asyncio.CancelledError:
            # a client leaving after an error event (the SDKs raise at it and close) is
            # answered: the event is judged, as the picker judges it
            if req.ctl.reason == "disconnect" and scanner.error_code is not None:
                self._ended(req, replica, scanner)
            elif req.ctl.reason == "disconnect" and scanner.done():
                # ... and so is one leaving after the stream's [DONE] (the official SDK
                # closes its response there) before the replica's body ended: a whole answer
                self._whole(req, replica, scanner)
            raise
        except TRANSPORT_ERRORS:
            if scanner.error_code is not None:  # the error event reached the client: its
                self._ended(req, replica, scanner)  # answer, judged; the stream ends as a
                # clean end after it does (a second error event said nothing more)
                req.ctl.done = True
                await self._end(send, req, b"")
                return False
            replica.record_failure(self._clock())
            if not req.relayed:  # no event reached the client: another replica can answer
                raise UpstreamError("The replica failed before its answer started.",
                                    reason="cut") from None
            self._refused_started(req, replica)
            req.ctl.done = True
            req.status = 502
            await self._end(send, req, stream_error("The upstream replica failed mid-stream."))
            return False
        if scanner.malformed and scanner.done_by is None:
            # the events before it went out (`_pump`), nothing after it (after the stream's
            # [DONE]: nothing more of kvgate's either, it was whole)
            replica.record_failure(self._clock())
            self._refused_started(req, replica)
            req.ctl.done = True
            req.status = 502
            failure = stream_failure(scanner, self._cfg.upstream.max_answer_bytes)
            await self._end(send, req, stream_error(failure.message))
            return False
        if not scanner.complete():
            # the replica ended the body cleanly but mid-answer (no [DONE]): the client must
            # not take it for a whole answer, nor get half an event (an error object instead
            # of one: its message)
            replica.record_failure(self._clock())
            said = ended_early(scanner, req.relayed)
            if not req.relayed:
                raise UpstreamError(said, reason="cut")
            self._refused_started(req, replica)
            req.ctl.done = True
            req.status = 502
            await self._end(send, req, stream_error(said))
            return False
        self._whole(req, replica, scanner)
        if held and (rid := response_id(held)) is not None:  # (a last event unended)
            self._responses.remember(rid, req.tenant_id, req.pool.name, replica.id,
                                     stored=stored_by_replica(req))
        rest = held + scanner.flush()
        if not req.sse:
            await self._start(send, req, resp)
        elif not req.relayed and rest:
            rest = self._answered_by(req) + rest
        await self._end(send, req, rest)  # (a client that stopped reading: `Canceller.end`)
        return True

    async def _end(self, send: Send, req: ProxiedRequest, last: bytes) -> None:
        """A stream's last bytes, its admission settled and its lease released first (as a
        whole answer's, `_answer`)."""
        await self._settle(req)
        await req.ctl.end(send, last)

    def _whole(self, req: ProxiedRequest, replica: Replica, scanner: StreamScanner) -> None:
        """A stream relayed whole: judged, its usage counted, and done (nothing may cancel
        it any more: a client leaving now is no 499, `Proxy._cancelled`)."""
        self._ended(req, replica, scanner)
        if scanner.usage:
            req.usage = scanner.usage
            req.used = total_tokens(scanner.usage)
            self._metrics.usage(req.pool.name, scanner.usage, req.tier, req.tenant)
        req.ctl.done = True

    def _ended(self, req: ProxiedRequest, replica: Replica, scanner: StreamScanner) -> None:
        """A started stream ended whole -- or after an error event reached the client, however
        it ended then (cut, reset, the client gone: the event was the answer) -- judged.
        vLLM's engine died mid-stream, or the request failed there: it sends an error event
        and [DONE] itself; the client gets them as sent, the request counts the event's code,
        a failure of the replica too unless no other one takes requests (as the picker judges
        it, `_stream_ended`)."""
        code = scanner.error_code
        if code is not None and code >= 500:
            self._refused_started(req, replica)  # (its first: `_pump`)
            now = self._clock()
            if alone_with_error_event(req.pool, replica, scanner, now):
                replica.count_failure()
            elif req.key_hash is not None and code == 500 and not dead_event(scanner):
                # vLLM's 500 for this request after its output began (a generation error,
                # not its dead engine's): no other replica can try it, so nothing tells whose
                # fault it was; charged only as a streak met by two tenants (`ErrorStreaks`:
                # one tenant's 3 such streams, sent where prefix affinity puts them, ejected
                # replica after replica)
                replica.count_failure()
                self._streaks.acquitted(replica, now, req.tenant_id)
            else:
                replica.record_failure(now)
            req.status = code
        else:
            if code is not None:  # a client error's event (the Responses API's 429, 400): the
                req.status = code  # request's answer, its replica served it
            served(replica)
            self._streaks.served(replica)

    def _refused_started(self, req: ProxiedRequest, replica: Replica) -> None:
        """A started stream failed: no retry can follow. Counted (`retries_refused`'s
        ``started``) only when another replica of the pool takes requests now, one that could
        have answered it (`no_other_replica`): a pool of one has nothing to refuse."""
        if not no_other_replica(req.pool, replica, self._clock()):
            self._metrics.retry_refused(req.pool.name, "started")

    def _lost(self, req: ProxiedRequest) -> None:
        """The stream's replica was found frozen, down by silence or stalled while the stream
        answered (`Lease.on_lost`): if the stream itself got no event for a /health timeout
        either, it is ended now -- the client gets the 504 error event "The replica stopped
        making progress ..." and the stream's end (`Proxy._cancelled`), its lease released --
        not after `upstream.idle_timeout_s` (2 minutes) of waiting for a replica nothing
        comes from. A stream still getting events is left to run: its replica is alive; so
        is one blocked handing its client a chunk (its silence is its client's: kvgate reads
        nothing more from the replica meanwhile)."""
        ctl = req.ctl
        quiet_s = asyncio.get_running_loop().time() - ctl.last
        if (ctl.done or ctl.reason is not None or ctl.writing
                or quiet_s < self._cfg.health.timeout_s):
            return
        log.info("replica found down or stalled: ending its stream", extra={
            "replica": req.replica, "request_id": req.req_id.decode("latin-1")})
        ctl.fire("stall")

    async def _start(self, send: Send, req: ProxiedRequest, resp: UpstreamResponse) -> None:
        """The stream's head goes to the client with its first bytes, not with the replica's
        head (vLLM sends that at once, before scheduling the prompt): until then a failed
        replica can still be replaced."""
        req.sse = True
        req.opened_by = req.replica
        await send({"type": "http.response.start", "status": 200,
                    "headers": self.headers(req, resp.content_type, resp.passed)})

    async def _pump(
        self, send: Send, req: ProxiedRequest, replica: Replica, resp: UpstreamResponse,
        lease: Lease, scanner: StreamScanner,
    ) -> bytes:
        """Relay chunks as they come. The engine has answered the prompt at the first SSE
        event (what the router learns from, and the first-byte timeout ends at; comment lines,
        blank lines and fields without data do not count: `no_event`, nor the Responses API's
        opening events). TTFT is taken when
        the first chunk carrying content reaches the client (not vLLM's role-only first chat
        chunk), inter-token latency is the gap between event chunks sent after it, and
        kvgate's relay overhead (upstream chunk received -> handed to the client) is sampled
        on every `RELAY_SAMPLE`-th chunk. A Responses API stream's opening events
        (``response.created``, ``response.in_progress``) answer nothing yet (vLLM sends
        them before the prompt is scheduled): they are held and go out with the first
        output, so another replica can still answer in their place -- except a ``background``
        one's (the replica finishes it whether or not kvgate reads on). Returns what is still
        held when the stream ends."""
        ctl = req.ctl
        itl = self._metrics.itl_child(req.pool.name)
        n = 0
        last_sent = 0.0
        answered = settled = False
        want_id = opening = req.kind == "responses"
        hold = opening and req.parsed.data.get("background") is not True
        held = b""
        limit = self._cfg.upstream.max_answer_bytes
        chunk = await resp.read_chunk()
        while chunk:
            received = perf_counter()
            replica.replies += 1  # it is alive (`Replica.frozen`)
            out = scanner.feed(chunk)
            if not req.relayed and (failure := unstarted_failure(scanner, limit)) is not None:
                # nothing reached the client: another replica may answer it, except when
                # it is too large (another replica's would be as large)
                now = self._clock()
                if scanner.error_code == 500 and not dead_event(scanner):
                    failure = self._suspect(req, replica, failure, now)
                elif alone_with_error_event(req.pool, replica, scanner, now):
                    replica.count_failure()
                elif not scanner.oversized:
                    replica.record_failure(now)
                raise failure
            if out:
                if no_event(out):  # keep-alives, fields without data: the replica waits
                    if not req.sse:  # (the client's connection is kept alive too)
                        await self._start(send, req, resp)
                    await ctl.hand_over(send, out)
                    chunk = await next_chunk(resp, scanner)  # (after the [DONE] too)
                    continue
                ctl.touch()
                preamble = not answered and opening and preamble_only(out)
                if not preamble:
                    # its engine works (`BlindWatch`): output, not keep-alives (sent by the
                    # API server while a hung engine sends nothing) nor a Responses preamble
                    replica.streamed += 1
                if preamble:
                    if hold:  # sent with the first output (or dropped for another replica)
                        held += out
                        chunk = await next_chunk(resp, scanner)
                        continue
                elif not answered:
                    answered = True
                    ctl.started()
                    lease.first_token()
                    lease.on_lost(partial(self._lost, req))
                    self._router.record_first_token(
                        replica.id, req.features, received - req.t0, self._clock())
                if held:
                    out, held = held + out, b""
                if not req.sse:  # (after `started`: a cut from now on is no first-byte one)
                    await self._start(send, req, resp)
                elif not req.relayed:
                    out = self._answered_by(req) + out
                req.relayed = True
                if want_id and (rid := response_id(out)) is not None:
                    want_id = False
                    self._responses.remember(rid, req.tenant_id, req.pool.name, replica.id,
                                             stored=stored_by_replica(req))
                if req.adm is not None and not settled and scanner.done():
                    # the stream's end goes out next: its usage charged and its tenant's
                    # concurrency lease given back first, so a client's next request, sent
                    # the moment it has the [DONE], finds it free (through a gateway nearer
                    # Redis than this one it was refused for concurrency, 5 times of 5)
                    settled = True
                    if scanner.usage:
                        req.used = total_tokens(scanner.usage)
                    await self._settle(req)
                await ctl.hand_over(send, out)  # (a client that stops reading blocks here)
                if req.streamed is not None:  # (what it used, if no usage comes: `spent_tokens`)
                    req.streamed += output_chars(out)
                sent = perf_counter()
                if req.ttft is not None:
                    itl.observe(sent - last_sent)
                elif carries_output(out):
                    req.ttft = sent - req.t0
                    self._metrics.first_token(req.pool.name, req.ttft, req.tier)
                last_sent = sent
                if n % RELAY_SAMPLE == 0:
                    self._metrics.relay.observe(sent - received)
                n += 1
            if scanner.malformed:
                return b""  # read no further: `relay` ends the stream with an error event
            chunk = await next_chunk(resp, scanner)
        return held
