"""Relaying one upstream answer to the client.

Split from `proxy.py` (which keeps the request's steps and the attempts); how a broken stream
ends is `stream_end.py`; what the answer says about its replica (`judge` and the rules both
edges share) is `verdicts.py`. A stream is passed through as bytes (`StreamScanner` reads the
usage chunk and notes error events); a whole answer is sent in one piece, its error body
re-shaped when it is not OpenAI's (`upstream_errors.py`).

TTFT is taken when the first chunk carrying generated output reaches the client; ``: keep-alive``
comment lines (``--sse-keep-alive-interval``), blank lines and fields without data (``event:
ping``, ``retry: 3000``, ``id: 7``: a proxy's) are neither the first token nor an inter-token
gap: the client's SSE parser dispatches no event for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter

from gateway.answer_headers import no_retry
from gateway.asgi import Send, send_whole
from gateway.config import KvgateConfig
from gateway.error_streaks import ErrorStreaks
from gateway.errors import (
    REQUEST_FAULT,
    AdapterGone,
    KvgateError,
    ReplicaWrongModel,
    RequestFailed,
    UpstreamError,
)
from gateway.metrics import GatewayMetrics
from gateway.replicas import Lease, Replica
from gateway.request import ProxiedRequest
from gateway.responses import ResponseStore, response_id
from gateway.sse import (
    StreamScanner,
    body_usage,
    carries_output,
    no_event,
    output_chars,
    preamble_only,
)
from gateway.stream_end import (
    ended_early,
    error_event,
    next_chunk,
    stream_error,
    stream_failure,
    unstarted_failure,
)
from gateway.transport import TRANSPORT_ERRORS, UpstreamResponse
from gateway.upstream_errors import ANSWERED_AN_ERROR, error_in_success, openai_shaped
from gateway.verdicts import (
    ENGINE_DIED,
    alone_with_error_event,
    busy_wait,
    dead_event,
    internal_error,
    judge,
    no_other_replica,
    not_an_answer,
    not_what_was_asked,
    relayed_retry_after,
    served,
)
from gateway.whole import CUT_ANSWER, cut_json, garbled, json_object, read_whole
from routing.router import Router

__all__ = ["Relay"]

log = logging.getLogger(__name__)

RELAY_SAMPLE = 16  # time the relay of one streamed chunk in this many (and the first)
# a whole Responses API answer waits this long at most for its id to reach Redis, so that a
# follow-up through another gateway finds it (a stream's id goes out with its first event)
_SHARE_WAIT_S = 1.0  # = the write's own timeout
_JSON = "application/json"


def _total(usage: dict[str, int]) -> int:
    return usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)


class Relay:
    def __init__(
        self, cfg: KvgateConfig, router: Router, metrics: GatewayMetrics,
        clock: Callable[[], float], responses: ResponseStore,
        settle: Callable[[ProxiedRequest], Awaitable[None]],
    ) -> None:
        self._settle = settle  # the admission, before a whole answer goes out
        self._cfg = cfg
        self._router = router
        self._metrics = metrics
        self._clock = clock
        self._responses = responses
        self._streaks = ErrorStreaks(cfg.health.failure_threshold)

    def headers(
        self, req: ProxiedRequest, content_type: str,
        passed: Sequence[tuple[bytes, bytes]] = (),
    ) -> list[tuple[bytes, bytes]]:
        """The head of an answer relayed: kvgate's headers and the replica's `passed` ones
        (`gateway.answer_headers`: end to end, none that kvgate sets)."""
        hdrs = [(b"content-type", content_type.encode("latin-1")), *passed,
                (b"x-request-id", req.req_id)]
        if self._cfg.server.replica_header:
            hdrs.append((b"x-kvgate-replica", f"{req.pool.name}/{req.replica}".encode()))
        if self._cfg.server.route_header:
            hdrs.append((b"x-kvgate-route", req.route.encode()))
        if req.extra:
            hdrs.extend(req.extra)
        if req.cors:
            hdrs.extend(req.cors)
        return hdrs

    def _answered_by(self, req: ProxiedRequest) -> bytes:
        """SSE comment lines naming the replica that answers a stream whose head went out
        with another try's keep-alive comments: the head's `x-kvgate-replica` and
        `x-kvgate-route` name that try's (hung) replica, and headers cannot change once
        sent. The SDKs skip comment lines, as they skip the keep-alives."""
        if req.opened_by == req.replica:
            return b""
        server = self._cfg.server
        lines = [f": x-kvgate-replica: {req.pool.name}/{req.replica}\n".encode()
                 ] if server.replica_header else []
        if server.route_header:
            lines.append(f": x-kvgate-route: {req.route}\n".encode())
        return b"".join(lines) + b"\n" if lines else b""

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
            req.ctl.done = True
            req.status = 502
            await self._end(send, req, stream_error("The upstream replica failed mid-stream."))
            return False
        if scanner.malformed and scanner.done_by is None:
            # the events before it went out (`_pump`), nothing after it (after the stream's
            # [DONE]: nothing more of kvgate's either, it was whole)
            replica.record_failure(self._clock())
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
            req.ctl.done = True
            req.status = 502
            await self._end(send, req, stream_error(said))
            return False
        self._whole(req, replica, scanner)
        if held and (rid := response_id(held)) is not None:  # (a last event unended)
            self._responses.remember(rid, req.tenant_id, req.pool.name, replica.id,
                                     stored=_stored(req))
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
            req.used = _total(scanner.usage)
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
            served(replica)
            self._streaks.served(replica)

    def _acquit(self, req: ProxiedRequest, replica: Replica, now: float) -> None:
        """A second replica failed the request with vLLM's 500 as the suspect did: neither is
        charged for it (the request fails wherever it runs), unless one keeps failing so
        while others serve (`ErrorStreaks`)."""
        suspect, req.suspect = req.suspect, None
        assert suspect is not None
        tenant = req.tenant_id if req.key_hash is not None else None
        for acquitted in (suspect, replica):
            self._streaks.acquitted(acquitted, now, tenant)

    def _suspect(
        self, req: ProxiedRequest, replica: Replica, failure: KvgateError, now: float,
    ) -> KvgateError:
        """A stream that opened with vLLM's error event of code 500 for this request (not a
        dead engine's), judged as a whole internal 500 is (`Proxy._forward`): one other
        replica tries it and tells whose fault it is; a second one alike, or none other to
        try it, is the request's answer (`REQUEST_FAULT`: no further try; `RequestFailed`
        after two), no replica's (`_acquit`). The failure to raise."""
        if req.suspect is not None:
            self._acquit(req, replica, now)
            return RequestFailed(failure.message)
        if not no_other_replica(req.pool, replica, now):
            req.suspect = replica
        else:  # the only replica: counted, not charged (one answer: the SDK may retry it)
            replica.count_failure()
            failure.reason = REQUEST_FAULT
        return failure

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
                if answered or not (opening and preamble_only(out)):
                    # its engine works (`BlindWatch`): output, not keep-alives (sent by the
                    # API server while a hung engine sends nothing) nor a Responses preamble
                    replica.streamed += 1
                if not answered and opening and preamble_only(out):
                    if hold:  # sent with the first output (or dropped for another replica)
                        held += out
                        chunk = await next_chunk(resp, scanner)
                        continue
                elif not answered:
                    answered = True
                    ctl.started()
                    lease.first_token()
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
                                             stored=_stored(req))
                if req.adm is not None and not settled and scanner.done():
                    # the stream's end goes out next: its usage charged and its tenant's
                    # concurrency lease given back first, so a client's next request, sent
                    # the moment it has the [DONE], finds it free (through a gateway nearer
                    # Redis than this one it was refused for concurrency, 5 times of 5)
                    settled = True
                    if scanner.usage:
                        req.used = _total(scanner.usage)
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

    async def _relay_whole(
        self, send: Send, req: ProxiedRequest, replica: Replica, resp: UpstreamResponse,
        lease: Lease,
    ) -> bool:
        req.ctl.headers_received()
        passed: Sequence[tuple[bytes, bytes]] = resp.passed
        try:
            data = await read_whole(resp, self._cfg.upstream.max_answer_bytes, req.ctl.touch)
        except TRANSPORT_ERRORS:
            replica.record_failure(self._clock())
            raise UpstreamError(CUT_ANSWER, reason="cut") from None
        stream = req.parsed.stream and req.kind != "embeddings"
        if resp.status == 200 and (stream or not json_object(resp.content_type, data)
                                   or garbled(resp.content_length is not None, data)):
            # every other 200 of a proxied route is JSON, and a stream asked for went to
            # `_pump`: an HTML page from whatever answered there, or a whole answer to a
            # stream, would reach the SDK as a str or as an empty stream that looks complete
            # (a JSON object that does not parse, as a JSON decode error)
            failure = not_what_was_asked(stream, resp.content_type)
            if stream and json_object(resp.content_type, data) and not garbled(
                    resp.content_length is not None, data):
                # a whole JSON answer to a stream: what this request asked (a route or format
                # vLLM does not stream) may be the cause, not the replica -- judged as a 500
                # for one request is; charged, one tenant's 3 such requests ejected a pool
                raise self._suspect(req, replica, failure, self._clock())
            replica.record_failure(self._clock())
            raise failure
        if resp.status == 200 and cut_json(resp.content_length is not None, data):
            # ended by a clean close mid-answer (its JSON cut at a nested object's "}")
            replica.record_failure(self._clock())
            raise UpstreamError(CUT_ANSWER, reason="cut")
        if resp.status == 200 and (said := error_in_success(data)) is not None:
            replica.record_failure(self._clock())  # (as a JSON error for a stream: `ended_early`)
            raise UpstreamError(f"{ANSWERED_AN_ERROR}{said}", reason="not_json")
        if 200 < resp.status < 400 and not req.sse:  # (opened by keep-alives: see below)
            # vLLM answers its routes 200 or an error; a 204, a 202 page or a redirect comes
            # from something else on that address (a proxy, an ingress redirecting to https):
            # relayed, the SDK failed on it (a JSON decode error, a str for a completion, an
            # APIStatusError 302) and a redirect told the client an internal address
            replica.record_failure(self._clock())
            raise not_an_answer(resp.status)
        lease.first_token()
        self._router.record_answered(replica.id, req.features, self._clock())
        if req.sse and resp.status < 400:
            # an earlier try's keep-alive comments opened the stream: a 2xx/3xx that is not
            # the stream can only end it with a 502 event (`error_event`), and the replica is
            # judged by what the client got, not by a status that looks like a success
            replica.record_failure(self._clock())
        elif internal_error(resp.status, data) and (
                req.suspect is not None or no_other_replica(req.pool, replica, self._clock())):
            # a second replica failed this request as the first did, or no other could try
            # it: relayed as the replica answered it, charged to neither (`_acquit`; a lone
            # replica's failure is counted: `Replica.count_failure`)
            if req.suspect is None:
                replica.count_failure()
            else:
                self._acquit(req, replica, self._clock())
                passed = no_retry(passed)  # the SDK's retries would fail alike
        elif (verdict := judge(replica, resp.status, data, self._clock(),
                               resp.retry_after, req.pool)) == "wrong_model":
            raise ReplicaWrongModel  # nothing was sent: another replica answers it
        elif verdict == "no_adapter" and req.pool.adapter_holders(req.parsed.model):
            # a LoRA adapter unloaded there and loaded on another: that one answers it (on
            # the last try, this 404 is the answer: `AdapterGone`)
            raise AdapterGone(data)
        elif verdict == "dead":
            # the last try's engine died (earlier tries' 500s never get here): the replica's
            # failure, not this request's; the proxy answers what the next request would get
            # (the pool's 503 when none is left), not a 500 that only this request sees
            raise UpstreamError(ENGINE_DIED, reason="dead")
        elif verdict == "ok":
            self._streaks.served(replica)
        content_type = resp.content_type
        if resp.status == 200:
            if usage := body_usage(data):
                req.usage = usage
                req.used = _total(usage)
                self._metrics.usage(req.pool.name, usage, req.tier, req.tenant)
            if req.kind == "responses" and (rid := response_id(data)) is not None:
                shared = self._responses.remember(rid, req.tenant_id, req.pool.name,
                                                  replica.id, stored=_stored(req))
                if shared is not None:  # the client may follow up through another gateway
                    await asyncio.wait({shared}, timeout=_SHARE_WAIT_S)
        elif resp.status >= 400 and (
                shaped := openai_shaped(resp.status, data, req.path)) is not None:
            data, content_type = shaped, "application/json"
        if resp.status == 501:  # vLLM's NotImplementedError: a feature the engine lacks, not
            passed = no_retry(passed)  # a failure the SDK's retries (every 5xx) could outlast
        wait = None
        if resp.status == 429:  # the soonest of the replicas that answered it 429
            wait = busy_wait(replica, resp.retry_after, self._clock())
            wait = wait if req.busy_wait is None else min(wait, req.busy_wait)
        retry_after = relayed_retry_after(resp.status, resp.retry_after, wait)
        await self._answer(send, req, resp.status, data, content_type, retry_after,
                           passed)
        return True

    async def relay_held(self, send: Send, req: ProxiedRequest, status: int, data: bytes) -> None:
        """An error answer read earlier (`Proxy._tries`: a suspect's 500), sent as
        `_relay_whole` sends one."""
        shaped = openai_shaped(status, data, req.path)
        await self._answer(send, req, status, shaped or data, _JSON)

    async def _answer(
        self, send: Send, req: ProxiedRequest, status: int, data: bytes, content_type: str,
        retry_after: bytes | None = None, passed: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        """A whole answer (with the replica's `passed` headers), settled first; when an
        earlier try's keep-alive comments opened the stream, its error event ends it instead
        (recorded as the client saw it)."""
        req.status = status
        req.ctl.done = True
        if req.sse:
            req.status, event = error_event(status, data)
            await self._settle(req)
            await req.ctl.end(send, self._answered_by(req) + event)
            return
        await self._settle(req)  # (its x-ratelimit-* headers then show the request settled)
        hdrs = self.headers(req, content_type, passed)
        if retry_after is not None:
            hdrs.append((b"retry-after", retry_after))
        await send_whole(send, status, hdrs, data)


def _stored(req: ProxiedRequest) -> bool:
    """Whether the replica keeps this response (``store`` defaults to true)."""
    return req.parsed is None or req.parsed.data.get("store") is not False
