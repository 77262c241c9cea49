"""Relaying one whole upstream answer to the client (`WholeRelay`, the base of `relay.Relay`,
which adds the stream): read whole within the size limit, judged (`verdicts.py`: cut, not
JSON, not an answer, an error in a 200, vLLM's 500 for one request suspected), settled, its
error body re-shaped when it is not OpenAI's (`upstream_errors.py`), sent in one piece; or,
when an earlier try's keep-alive comments opened the stream, ended with an error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

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
from gateway.sse import body_usage
from gateway.stream_end import error_event
from gateway.transport import TRANSPORT_ERRORS, UpstreamResponse
from gateway.upstream_errors import ANSWERED_AN_ERROR, error_in_success, openai_shaped
from gateway.verdicts import (
    ENGINE_DIED,
    busy_wait,
    internal_error,
    judge,
    no_other_replica,
    not_an_answer,
    not_what_was_asked,
    relayed_retry_after,
)
from gateway.whole import CUT_ANSWER, cut_json, garbled, json_object, read_whole
from routing.router import Router

__all__ = ["WholeRelay", "stored_by_replica", "total_tokens"]

# a whole Responses API answer waits this long at most for its id to reach Redis, so that a
# follow-up through another gateway finds it (a stream's id goes out with its first event)
_SHARE_WAIT_S = 1.0  # = the write's own timeout
_JSON = "application/json"


def total_tokens(usage: dict[str, int]) -> int:
    return usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)


class WholeRelay:
    """A whole answer relayed (`_relay_whole`), the head of any answer (`headers`), and the
    judging of a request suspected of its own failure (`_suspect`, `_acquit`); `Relay` adds
    the stream."""

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
                req.used = total_tokens(usage)
                self._metrics.usage(req.pool.name, usage, req.tier, req.tenant)
            if req.kind == "responses" and (rid := response_id(data)) is not None:
                shared = self._responses.remember(rid, req.tenant_id, req.pool.name,
                                                  replica.id, stored=stored_by_replica(req))
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


def stored_by_replica(req: ProxiedRequest) -> bool:
    """Whether the replica keeps this response (``store`` defaults to true)."""
    return req.parsed is None or req.parsed.data.get("store") is not False
