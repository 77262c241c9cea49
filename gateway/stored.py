"""``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: sent to the replica that
holds the stored response (`ResponseStore`), as the tenant that created it. ``HEAD`` is GET
without the body: the replica is asked with GET, the server leaves the body out.

Authentication is the proxied routes' (the bearer key -> tenant); an id this gateway did not
relay for this tenant is a 404 in OpenAI's shape, as vLLM itself answers for an unknown id,
and one Redis could not be asked about (`ResponseLookupFailed`) a 503 to retry.
The answer is relayed whole, read as a proxied whole answer is (`whole.read_whole`: past
``upstream.max_answer_bytes`` it is the 502 `AnswerTooLarge`, ``x-should-retry: false``, and the
connection is dropped); an error body that is not OpenAI-shaped is re-shaped; a replica
refusing kvgate's own credentials (401/403) is a 502 (`ReplicaRefused`).

``GET /v1/responses/{id}?stream=true[&starting_after=N]`` is vLLM's resumption of a background
response's event stream (``retrieve_responses`` in its Responses API router: it replays the
stored events after ``starting_after`` and follows the running ones until
``response.completed``). It is relayed as it arrives (`stream`), under the upstream
first-byte / idle / total timeouts, and dropped upstream when the client leaves. vLLM keeps
events only for a response created with ``background`` and ``stream`` both true; for another
one it sends the stream's head and then breaks the connection: kvgate answers that (and any
stream that ends before its first event) with a 502 saying so, as it does a 200 that is not
a stream (a replica that ignores ``stream``: the SDK would take it for an empty stream) and a
first read holding an event that is not a JSON object or too large (good events before it included:
the head has not gone out, `relay.unstarted_failure`); a stream cut later, or with an event
that is not a JSON object, ends with an error event as a proxied one does. ``HEAD`` with
``?stream=true`` is the stream's head at its first event (the endpoint picker answers it with
`stream_head`).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from urllib.parse import parse_qsl

from gateway.asgi import Headers, Message, Receive, Scope, Send, send_whole
from gateway.config import ServerConfig, UpstreamConfig
from gateway.drain import interruptible
from gateway.errors import (
    REFUSED,
    KvgateError,
    MethodNotAllowed,
    NotFound,
    ReplicaRefused,
    UpstreamError,
    UpstreamTimeout,
    shown_name,
)
from gateway.httpguard import abort_client
from gateway.pool import Pool, Pools
from gateway.replicas import Replica
from gateway.responses import ResponseStore, home_out
from gateway.sse import StreamScanner
from gateway.stream_end import (
    CUT_SHORT,
    next_chunk,
    stream_error,
    stream_failure,
    unstarted_failure,
)
from gateway.tenancy.edge import TenantGate
from gateway.timeouts import Canceller, cut_error
from gateway.transport import TRANSPORT_ERRORS, UpstreamResponse, connect_failure, refused
from gateway.upstream_errors import ANSWERED_AN_ERROR, error_in_success, openai_shaped
from gateway.verdicts import not_an_answer, not_what_was_asked
from gateway.whole import cut_json, fetch_whole, json_object, read_whole

__all__ = ["NOT_IN_TIME", "NO_EVENTS", "UNANSWERED", "StoredResponses", "match_stored",
           "not_a_stream", "wants_stream"]

log = logging.getLogger(__name__)

_PATH = re.compile(r"^/v1/responses/([A-Za-z0-9_.\-]{1,256})(/cancel)?$")
_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})  # a true bool in vLLM's (FastAPI) query
NO_EVENTS = ("The replica ended the stream before its first event (vLLM streams a stored "
             "response only when it was created with background and stream true).")
UNANSWERED = "The replica holding this response did not answer."
NOT_IN_TIME = "The replica did not answer in time."  # a whole answer, past its bound


def wants_stream(query: bytes) -> bool:
    """``stream=true`` in the query string (the last one counts, as in vLLM's parsing)."""
    if b"stream" not in query:
        return False
    values = [v for k, v in parse_qsl(query.decode("latin-1")) if k == "stream"]
    return bool(values) and values[-1].strip().lower() in _TRUE


def not_a_stream(content_type: str) -> UpstreamError:
    """A 200 to ``?stream=true`` that is not an event stream (a vLLM that ignores `stream`, or
    not vLLM): the SDK would read the whole object as a stream without events, which looks
    complete. Both edges answer it with this 502."""
    media = content_type.partition(";")[0].strip()[:64] or "no content type"
    return UpstreamError(f"The replica's answer is not the stream asked for ({media}).")


def match_stored(path: str) -> bool:
    return path.startswith("/v1/responses/")


class StoredResponses:
    def __init__(
        self, pools: Pools, gate: TenantGate, store: ResponseStore, up: UpstreamConfig,
        server: ServerConfig,
    ) -> None:
        self._pools = pools
        self._gate = gate
        self._store = store
        self._up = up
        self._server = server
        self._timeout = min(up.first_byte_timeout_s, up.total_timeout_s)

    def where(self, home: str) -> list[tuple[bytes, bytes]]:
        """``x-kvgate-replica`` (the ``pool/replica`` holding it) and ``x-kvgate-route``, as
        ``server.replica_header`` / ``server.route_header`` say (as on proxied answers)."""
        out = [(b"x-kvgate-replica", home.encode())] if self._server.replica_header else []
        if self._server.route_header:
            out.append((b"x-kvgate-route", b"response-affinity"))
        return out

    async def handle(
        self, scope: Scope, receive: Receive, send: Send, req_id: bytes, token: str | None
    ) -> None:
        path: str = scope["path"]
        method: str = scope["method"]
        if method in ("GET", "HEAD") and wants_stream(scope.get("query_string", b"")):
            await self.stream(scope, receive, send, req_id, token)
            return
        try:
            status, content_type, body, where, passed = await self.whole(
                path, method, scope.get("query_string", b""), token, req_id)
        except KvgateError as exc:
            await _send_error(send, exc, req_id)
            return
        await send_whole(send, status, _headers(content_type, req_id, self.where(where), passed),
                         body)

    async def stream(
        self, scope: Scope, receive: Receive, send: Send, req_id: bytes, token: str | None
    ) -> None:
        """``?stream=true``: the replica's event stream, relayed as it arrives."""
        path: str = scope["path"]
        try:
            await self.lookup(path, token)
            pool, replica = self.locate(path, "GET", token, head=True)
        except KvgateError as exc:
            await _send_error(send, exc, req_id)
            return
        where = f"{pool.name}/{replica.id}"
        url = f"{replica.url}{path}?{scope['query_string'].decode('latin-1')}"
        headers = _upstream_headers(pool, req_id)
        ctl = Canceller(self._up, receive)
        pipe = _Pipe(send, ctl, req_id, self.where(where), self._up.max_answer_bytes,
                     head_only=scope["method"] == "HEAD")
        resp: UpstreamResponse | None = None
        clean = False
        try:
            with interruptible(ctl):  # ended cleanly at the end of the shutdown grace
                try:
                    resp = await pool.transport.open(url, headers)
                except TRANSPORT_ERRORS as exc:
                    raise _unanswered(exc, pool, replica, path) from None
                if resp.status in REFUSED:
                    raise ReplicaRefused(resp.status)
                clean = await pipe.relay(resp)
        except asyncio.CancelledError:
            if ctl.reason is None:
                raise  # a real cancellation, not ours to swallow
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            if ctl.reason == "client":  # it stopped reading: reset, as a proxied stream
                ctl.stalled = True
            elif ctl.reason != "disconnect":
                await pipe.fail(cut_error(ctl.reason))
        except KvgateError as exc:
            await pipe.fail(exc)
        finally:
            ctl.close()
            if resp is not None:
                resp.release() if clean else resp.abort()
        if ctl.stalled:  # (or its last piece was not taken: `Canceller.end`)
            abort_client(scope)
            log.info("client stopped reading the stream",
                     extra={"request_id": req_id.decode("latin-1")})

    async def stream_head(
        self, path: str, query: bytes, req_id: bytes, token: str | None
    ) -> tuple[int, Headers, bytes]:
        """``HEAD ...?stream=true`` for the endpoint picker, which answers it itself (Envoy
        cannot send a HEAD on as GET): `stream` run as for the HTTP edge, its answer kept --
        the stream's head at its first event, or the error before it (status, headers,
        body)."""
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        async def receive() -> Message:  # no client disconnect to report: wait forever
            return await asyncio.get_running_loop().create_future()  # type: ignore[no-any-return]

        scope = {"method": "HEAD", "path": path, "query_string": query}
        await self.stream(scope, receive, send, req_id, token)
        if not sent:  # (not expected: every way out of `stream` answers)
            raise UpstreamError(UNANSWERED)
        body = b"".join(m.get("body", b"") for m in sent[1:])
        return sent[0]["status"], sent[0]["headers"], body

    async def lookup(self, path: str, token: str | None) -> None:
        """Learn where the response `path` names lives when another gateway relayed it;
        only for a caller with a valid key (`locate` answers the others). A lookup Redis
        does not answer is `ResponseLookupFailed` (503): it was a 404, which told the client
        its response was gone."""
        m = _PATH.match(path)
        if m is None:
            return
        try:
            self._gate.principal(token)
        except KvgateError:
            return
        await self._store.fetch(m.group(1))

    def locate(
        self, path: str, method: str, token: str | None, *, head: bool = False
    ) -> tuple[Pool, Replica]:
        """The pool and replica holding the response `path` names, for the caller of `token`
        (401, 404, 405 as `KvgateError`s; `head`: the 405 names HEAD too, the caller asks the
        replica with GET). The Envoy endpoint picker routes with it too."""
        principal = self._gate.principal(token)
        m = _PATH.match(path)
        if m is None:
            raise NotFound(f"Unknown path {shown_name(path)}.")
        cancel = m.group(2) is not None
        if method != ("POST" if cancel else "GET"):
            allowed = "POST" if cancel else "GET, HEAD" if head else "GET"
            raise MethodNotAllowed(f"Use {allowed} for {path}.", allow=allowed)
        rid = m.group(1)
        home = self._store.home(rid, principal.tenant_id)
        pool = self._pools.by_name.get(home.pool) if home is not None else None
        replica = pool.by_id.get(home.replica) if pool is not None and home is not None else None
        if pool is None or replica is None:
            raise NotFound(f"Response with id '{shown_name(rid)}' not found.", param="response_id")
        # (the app's clock: `Replica` times are monotonic seconds)
        if (out := home_out(pool, replica, rid, time.monotonic(), follow_up=False)) is not None:
            raise out
        return pool, replica

    async def whole(
        self, path: str, method: str, query: bytes, token: str | None, req_id: bytes,
    ) -> tuple[int, str, bytes, str, list[tuple[bytes, bytes]]]:
        """The replica's whole answer: status, content type, body (an error re-shaped into
        OpenAI's), ``pool/replica`` and the replica's headers that reach the client
        (`gateway.answer_headers`). ``HEAD`` is asked as GET: the server answering the
        client leaves the body out (uvicorn here, Envoy for the picker). Its head must come
        within the first of the first-byte and total timeouts, then each gap in its body
        within ``idle_timeout_s`` (`whole.read_whole`'s touch), all within the total."""
        await self.lookup(path, token)
        if method == "HEAD":
            method = "GET"
        pool, replica = self.locate(path, method, token, head=True)
        url = replica.url + path + (f"?{query.decode('latin-1')}" if query else "")
        headers = _upstream_headers(pool, req_id)
        up = self._up
        try:  # bounded as a proxied whole answer's
            resp, body = await fetch_whole(
                pool.transport, url, headers, method, head_s=self._timeout,
                idle_s=up.idle_timeout_s, total_s=up.total_timeout_s,
                max_bytes=up.max_answer_bytes, on_head=_refused)
        except TimeoutError:
            raise UpstreamTimeout(NOT_IN_TIME) from None
        except TRANSPORT_ERRORS as exc:
            raise _unanswered(exc, pool, replica, path) from None
        status, content_type = resp.status, resp.content_type
        if 200 < status < 400:  # vLLM answers 200 or an error: a 204, a redirect (to an
            raise not_an_answer(status)  # internal address) is something else's at its address
        if status == 200 and not json_object(content_type, body):  # an HTML page, a cut body
            raise not_what_was_asked(False, content_type)
        if status == 200 and cut_json(resp.content_length is not None, body):
            raise UpstreamError(UNANSWERED)  # ended by a clean close mid-answer, as by a reset
        if status == 200 and (said := error_in_success(body)) is not None:
            raise UpstreamError(f"{ANSWERED_AN_ERROR}{said}")
        if status >= 400 and (shaped := openai_shaped(status, body)) is not None:
            body, content_type = shaped, "application/json"
        return status, content_type, body, f"{pool.name}/{replica.id}", resp.passed


def _unanswered(exc: BaseException, pool: Pool, replica: Replica, path: str) -> KvgateError:
    """A stored response's replica failed to answer: nothing listening there (refused,
    unreachable) is found down now, as a proxied request finds it (`Replica.mark_down`), and
    the answer is the 503 of a down holder (`home_out`, with `Retry-After`); a reset or a
    close is the 502 `UNANSWERED`. Before, the first request meeting a killed holder before
    its health checks did was that 502 (the next ones the 503)."""
    m = _PATH.match(path)
    if refused(exc) and m is not None:
        now = time.monotonic()  # (the app's clock, as `locate`'s)
        replica.mark_down(now, reason=connect_failure(exc, replica.url), gone=True)
        if (out := home_out(pool, replica, m.group(1), now, follow_up=False)) is not None:
            return out
    return UpstreamError(UNANSWERED)


def _refused(resp: UpstreamResponse) -> None:
    if resp.status in REFUSED:  # kvgate's credentials, not the client's
        raise ReplicaRefused(resp.status)


def _upstream_headers(pool: Pool, req_id: bytes) -> dict[str, str]:
    """What the replica is sent: the pool's credentials (no body: no content type) and the
    request id the client's answer carries, as on proxied requests (both edges)."""
    headers = {k: v for k, v in pool.headers.items() if k != "Content-Type"}
    headers["X-Request-Id"] = req_id.decode("latin-1")
    return headers


def _headers(
    content_type: str, req_id: bytes, where: list[tuple[bytes, bytes]],
    passed: list[tuple[bytes, bytes]],
) -> list[tuple[bytes, bytes]]:
    """A stored answer's head: kvgate's headers and the replica's `passed` ones (as a proxied
    answer's, `WholeRelay.headers`)."""
    return [(b"content-type", content_type.encode("latin-1")), *passed,
            (b"x-request-id", req_id), *where]


async def _send_error(send: Send, exc: KvgateError, req_id: bytes) -> None:
    await send_whole(send, exc.status, [*exc.headers(), (b"x-request-id", req_id)], exc.body())


class _Pipe:
    """One stored response's stream on its way to the client: its head goes out with the
    first event (until then a failure is a whole JSON error), then events as they come."""

    def __init__(self, send: Send, ctl: Canceller, req_id: bytes,
                 where: list[tuple[bytes, bytes]], limit: int, *, head_only: bool) -> None:
        self._send = send
        self._limit = limit  # upstream.max_answer_bytes: the whole answer, or one event
        self._ctl = ctl
        self._req_id = req_id
        self._where = where
        self._head_only = head_only  # HEAD: the head (with the first bytes, left out)
        self._passed: list[tuple[bytes, bytes]] = []  # the replica's headers for the client
        self.started = False

    async def relay(self, resp: UpstreamResponse) -> bool:
        """True when the replica's answer was read to its end."""
        sse = resp.content_type.startswith("text/event-stream")
        self._passed = resp.passed
        if resp.status == 200 and not sse:
            raise not_a_stream(resp.content_type)
        if not (resp.status == 200 and sse):
            self._ctl.headers_received()  # an error, or the whole object: as it is
            body = await read_whole(resp, self._limit, self._ctl.touch)
            content_type = resp.content_type
            if resp.status >= 400 and (shaped := openai_shaped(resp.status, body)) is not None:
                body, content_type = shaped, "application/json"
            await send_whole(self._send, resp.status,
                             _headers(content_type, self._req_id, self._where, self._passed),
                             body)
            return True
        scanner = StreamScanner(strip_usage=False, max_event_bytes=self._limit)
        try:
            while chunk := await next_chunk(resp, scanner):  # (its end: 1 s after the last
                out = scanner.feed(chunk)  # event, `response.completed`, at most)
                if not self.started and (failure := unstarted_failure(
                        scanner, self._limit, error_events=False)) is not None:
                    raise failure  # the events before it in this read are not sent
                if out and not await self._events(out):
                    return False
                if scanner.malformed:  # not JSON, or too large: not read on
                    raise stream_failure(scanner, self._limit)
        except TRANSPORT_ERRORS:
            raise UpstreamError(NO_EVENTS if not self.started
                                else "The upstream replica failed mid-stream.") from None
        if not self.started:
            raise UpstreamError(NO_EVENTS)
        if not scanner.complete():
            raise UpstreamError(CUT_SHORT)
        self._ctl.done = True
        await self._ctl.end(self._send, scanner.flush())
        return True

    async def _events(self, out: bytes) -> bool:
        """Hand whole events to the client; False when nothing more is wanted (HEAD)."""
        ctl = self._ctl
        if not self.started:
            self.started = True
            ctl.started()
            await self._send({"type": "http.response.start", "status": 200, "headers":
                              _headers("text/event-stream", self._req_id, self._where,
                                       self._passed)})
            if self._head_only:  # the server leaves the body out of a HEAD's answer; the
                ctl.done = True  # picker's Envoy keeps the content type only with one
                await self._send({"type": "http.response.body", "body": out,
                                  "more_body": False})
                return False
        ctl.touch()
        await ctl.hand_over(self._send, out)  # (a client that stops reading blocks here)
        return True

    async def fail(self, exc: KvgateError) -> None:
        """A JSON error before the stream started; after: an error event and [DONE]."""
        self._ctl.done = True
        if not self.started:
            await _send_error(self._send, exc, self._req_id)
        elif not self._ctl.blocked:  # (a client that stopped reading gets nothing more)
            await self._ctl.end(self._send, stream_error(exc.message, exc.type_, exc.status))
