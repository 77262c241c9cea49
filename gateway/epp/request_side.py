"""The request side of an exchange: Envoy's request headers, body and trailers in; a
refusal, kvgate's own page, or the destination and the rewritten body out (module docstring
of `gateway.epp.exchange`)."""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.apikey import KEY_HEADERS, KeyScan
from gateway.app import POSTED, unknown_path
from gateway.epp import wire
from gateway.epp.modes import BUFFERED, modes, unsupported
from gateway.epp.modes import buffered_body as modes_buffered
from gateway.epp.state import ExchangeState, endpoint, replica_key
from gateway.errors import (
    BodyTooLarge,
    EncodedBody,
    FormBody,
    KvgateError,
    MethodNotAllowed,
    MultipartBody,
    NoReplicaAvailable,
    UploadsFull,
)
from gateway.paths import canonical
from gateway.proxy import KINDS, MODEL_PREFIX, MODELS
from gateway.request import ProxiedRequest, Uploads, replica_id, request_id
from gateway.stored import (
    match_stored,
    wants_stream,
)
from gateway.tokenizer_info import TOKENIZER_INFO

__all__ = ["RequestSide"]


class RequestSide(ExchangeState):
    """Who is asking and for what; where it goes."""

    __slots__ = ()

    # -- request path ----------------------------------------------------------------------
    async def request_headers(
        self, msg: pb.ProcessingRequest,
    ) -> Sequence[pb.ProcessingResponse]:
        """Who is asking and for what; nothing is answered before the body (unless refused),
        but in ``BUFFERED`` body mode, where the body answer says where it goes (`modes`)."""
        stated = modes(msg)
        self._buffered = stated is not None and stated[0] == BUFFERED
        out = await self._asked(msg)
        if stated is not None and not (out and out[0].HasField("immediate_response")):
            wrong = unsupported(stated, not msg.request_headers.end_of_stream)
            if wrong is not None:  # no body would come: it waited for the body timeout's 408
                self._core.misconfigured("processing_mode", wrong.message)
                self._pending = None
                return [self._refuse(wrong)]
        if self._buffered and not out and not msg.request_headers.end_of_stream:
            return [wire.headers_response(request=True)]  # unchanged: the body's answer
        return out

    async def _asked(self, msg: pb.ProcessingRequest) -> Sequence[pb.ProcessingResponse]:
        core = self._core
        self._t0 = perf_counter()
        path, query, method, token, sent_id, declared, encoded, multipart, self._form = _scan(
            msg.request_headers.headers.headers)
        if (path[-1:] == "/" or "//" in path) and (route := canonical(path)) != path:
            path = route  # as the HTTP edge (`gateway/paths.py`): the replica gets the route's
            self._slashed = path.encode() + (b"?" + query if query else b"")
        self._path = path
        kind = KINDS.get(path)
        if kind is None and match_stored(path):
            req_id = self._req_id = request_id(sent_id, core.new_id)
            if method == "HEAD":
                return [await self._head_stored(path, query, req_id, token)]
            if declared is not None and declared > core.cfg.server.max_body_bytes:
                try:  # a cancel's: bounded as any body, once the key is known good (401
                    core.prep.authenticate(token)  # first, as on the proxied routes)
                except KvgateError as exc:
                    return [self._refuse(exc)]
                return [self._refuse(self._too_large())]
            self._stream = wants_stream(query) and method == "GET"
            try:  # relayed by another gateway (Redis); not answered there: a 503, not a 404
                await self._core.stored.lookup(path, token)
            except KvgateError as exc:
                return [self._refuse(exc)]
            out = self._to_stored(path, method, token)
            if msg.request_headers.end_of_stream or out.HasField("immediate_response"):
                return [out]
            self._pending = out
            return []
        if path == TOKENIZER_INFO:
            return [await self._tokenizer_info(method, query, token, sent_id)]
        if kind is None or method != "POST":
            return [self._not_proxied(path, method, token)]  # (no x-request-id, as there)
        req_id = self._req_id = request_id(sent_id, core.new_id)
        req = self.req = ProxiedRequest(path, kind, req_id, self._t0,
                                        replica_id(req_id, sent_id, core.new_id))
        hint = wire.subset_hint(msg)
        self._subset = frozenset(map(replica_key, hint)) if hint is not None else None
        try:
            self._principal = core.prep.identify(req, token)
            if encoded:  # (its bytes would be judged "not JSON"), as at the HTTP edge
                raise EncodedBody
            if multipart:  # a file upload: the HTTP edge's 415, not "not valid JSON" (400)
                raise MultipartBody(path, envoy=True)
            if declared is not None and declared > core.cfg.server.max_body_bytes:
                raise self._too_large()
            await core.prep.before_body(req, self._principal, declared)
        except KvgateError as exc:
            return [self._refuse(exc)]
        return []

    async def request_body(self, msg: pb.ProcessingRequest) -> Sequence[pb.ProcessingResponse]:
        body = msg.request_body
        self._size += len(body.body)
        if self._size > self._core.cfg.server.max_body_bytes:
            return [self._refuse(self._too_large())]
        if not body.end_of_stream or self._chunks:  # arriving in parts: bounded, all together
            try:  # (`server.max_pending_body_bytes`, a 503: as the HTTP edge's `read_body`;
                # a tenant's share of it too)
                self._core.uploads.take(len(body.body), Uploads.owner(self.req))
            except UploadsFull as exc:
                return [self._refuse(exc)]
            self._taken += len(body.body)
        if body.body:
            self._chunks.append(body.body)
        if self._buffered:  # the whole body, in one message (trailers may follow): answered
            self._uploaded()  # with the destination, as one body answer
            return modes_buffered(self._stored_body(end=True) or await self.decide(end=True))
        if not body.end_of_stream:
            return []
        self._uploaded()
        return self._stored_body(end=True) or await self.decide(end=True)

    async def request_trailers(self) -> Sequence[pb.ProcessingResponse]:
        """Trailers end the body when they follow it (HTTP/2 clients may send them)."""
        self._uploaded()
        out = self._stored_body(end=False)
        if not out and not self.order:
            out = list(await self.decide(end=False))
        if out and out[0].HasField("immediate_response"):
            return out
        return [*out, wire.trailers_response(request=True)]

    def _stored_body(self, *, end: bool) -> list[pb.ProcessingResponse]:
        """A stored response's request body is in: its destination, then the body as it
        came (vLLM's cancel ignores it)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        body, self._chunks = b"".join(self._chunks), []
        return [pending, *wire.body_responses(body, end, request=True)]

    async def decide(self, *, end: bool) -> Sequence[pb.ProcessingResponse]:
        """The body is complete: the shared step, then the destination and the new body."""
        req, principal = self.req, self._principal
        if req is None or principal is None or self.order:
            return []
        core = self._core
        body = b"".join(self._chunks)
        self._chunks = []
        try:
            if self._form and body[:1].isalpha():  # form fields (no JSON text starts so): the
                raise FormBody(req.path)  # HTTP edge's 415, not "not valid JSON" (400)
            decision, upstream = await core.prep.prepare(req, principal, body, self._subset)
            pool = req.pool
            picked = (decision.replica, *decision.fallbacks)[: 1 + core.fallbacks]
            self.order = [r for rid in picked if (r := pool.by_id.get(rid)) is not None]
            if not self.order:
                raise NoReplicaAvailable("The chosen replica left its pool; try again.")
        except KvgateError as exc:
            return [self._refuse(exc)]
        req.route = "spill" if req.spilled else decision.reason
        self._attach(self.order[0])
        self._sent_at = perf_counter()
        core.metrics.pre_upstream.observe(req.own_time(self._sent_at))
        set_headers, remove = _credentials(pool.headers.get("Authorization"))
        if req.parsed.stream and req.kind != "embeddings":
            remove += (wire.WHOLE,)  # a client's: a stream keeps the first-byte bound
        else:  # comes whole, after its last token: the total timeout bounds it, as at the edge
            set_headers.append((wire.WHOLE, b"1"))
        # the body is JSON (parsed, rewritten): said so whatever the client declared (curl's
        # `-d` sends a form type), as the HTTP edge does; vLLM takes no other type
        set_headers += [("accept-encoding", b"identity"), ("x-request-id", req.up_id),
                        ("content-type", b"application/json"),
                        # Envoy's retries stay on the list (past its end, round robin over the
                        # whole cluster: endpoints outside the data plane's subset, other pools')
                        (wire.MAX_RETRIES, str(len(self.order) - 1).encode())]
        if self._slashed:  # vLLM would redirect: the route's own path (ext_proc may set :path)
            set_headers.append((":path", self._slashed))
        destination = ",".join(endpoint(r) for r in self.order)
        return [wire.destination_response(destination, len(upstream), set_headers, remove),
                *wire.body_responses(upstream, end, request=True)]

    def _to_stored(self, path: str, method: str, token: str | None) -> pb.ProcessingResponse:
        """``GET /v1/responses/{id}``, ``POST .../cancel``: to the replica that holds it."""
        try:
            pool, replica = self._core.stored.locate(path, method, token, head=True)
        except KvgateError as exc:
            return self._refuse(exc)
        self._stored = f"{pool.name}/{replica.id}"
        self._sent_at = perf_counter()
        set_headers, remove = _credentials(pool.headers.get("Authorization"))
        remove += (wire.WHOLE,)  # bounded by the first-byte timeout too, a client's marker off
        set_headers.append(("x-request-id", self._req_id))  # the answer's, as the HTTP edge
        set_headers.append((wire.MAX_RETRIES, b"0"))  # no other replica holds it
        if self._slashed:  # the route's own path (`gateway/paths.py`)
            set_headers.append((":path", self._slashed))
        return wire.destination_response(endpoint(replica), None, set_headers, remove)

    async def _head_stored(
        self, path: str, query: bytes, req_id: bytes, token: str | None,
    ) -> pb.ProcessingResponse:
        """``HEAD /v1/responses/{id}``: GET without the body, as in the HTTP mode. vLLM has no
        HEAD routes (405), and Envoy's ext_proc may not change ``:method`` by default
        (`allow_all_routing`), so the picker asks the replica with GET itself and answers with
        that: Envoy sends a HEAD's local reply with the body's length and without the body.
        With ``?stream=true`` it is the stream's head, as the HTTP edge answers it (the
        replica's stream up to its first event, or the error before it)."""
        stored = self._core.stored
        try:
            if wants_stream(query):  # (the replica/route headers as configured)
                status, sent, body = await stored.stream_head(path, query, req_id, token)
            else:
                status, content_type, body, home, passed = await stored.whole(
                    path, "HEAD", b"", token, req_id)
                sent = [(b"content-type", content_type.encode("latin-1")), *passed,
                        (b"x-request-id", req_id), *stored.where(home)]
        except KvgateError as exc:
            return self._refuse(exc)
        headers = [(k.decode(), v) for k, v in sent if k != b"content-length"]  # Envoy's
        return wire.immediate(status, body, headers, "kvgate_stored_head")

    def _not_proxied(self, path: str, method: str, token: str | None) -> pb.ProcessingResponse:
        """A route that is not proxied: kvgate's own pages, else OpenAI's 404/405."""
        if path in KINDS:
            return self._refuse(MethodNotAllowed(f"Use POST for {path}.", allow="POST"))
        # as the HTTP edge: GET and HEAD, and POST where vLLM takes it (`POST /ping`)
        get = method in ("GET", "HEAD") or (method == "POST" and path in POSTED)
        principal = None
        if get and (path == MODELS or (path.startswith(MODEL_PREFIX) and path != MODEL_PREFIX)):
            try:  # as the HTTP edge: a valid key, and the models of its tier
                principal = self._core.prep.authenticate(token)
            except KvgateError as exc:
                return self._refuse(exc)
        page = self._core.page(path, principal) if get else None
        if page is None and not get and self._core.page(path, None) is not None:
            allow = "GET, HEAD, POST" if path in POSTED else "GET, HEAD"
            return self._refuse(MethodNotAllowed(f"Use GET for {path}.", allow=allow))
        if page is None:
            return self._refuse(unknown_path(path))  # with a hint when /v1 is missing
        status, headers, body = page
        return wire.immediate(status, body, [(k.decode(), v) for k, v in headers], "kvgate_page")

    async def _tokenizer_info(self, method: str, query: bytes, token: str | None,
                              sent_id: bytes) -> pb.ProcessingResponse:
        """vLLM's ``GET /tokenizer_info``, answered as the HTTP edge answers it (the picker
        asks the replica itself: `gateway.tokenizer_info`); it was the picker's 404."""
        core = self._core
        if method not in ("GET", "HEAD"):  # (Envoy leaves a HEAD's local reply body out)
            return self._refuse(MethodNotAllowed(f"Use GET for {TOKENIZER_INFO}.",
                                                 allow="GET, HEAD"))
        req_id = request_id(sent_id, core.new_id)
        status, headers, body = await core.tokenizer_info.reply(
            token, query, req_id, replica_id(req_id, sent_id, core.new_id))
        return wire.immediate(status, body, [(k.decode(), v) for k, v in headers],
                              "kvgate_tokenizer_info")

    def _too_large(self) -> BodyTooLarge:
        limit = self._core.cfg.server.max_body_bytes
        return BodyTooLarge(f"The request body exceeds the limit of {limit} bytes.")


# the client's key headers, as Envoy names them; none of them reaches a replica
_KEY_HEADERS = frozenset(name.decode() for name in KEY_HEADERS)
_ALT_KEY_HEADERS = tuple(sorted(_KEY_HEADERS - {"authorization"}))


def _credentials(creds: str | None) -> tuple[list[wire.Header], tuple[str, ...]]:
    """The pool's vLLM key replaces the client's (which never reaches a replica, in whichever
    header it came)."""
    if creds:
        return [("authorization", creds.encode())], _ALT_KEY_HEADERS
    return [], ("authorization", *_ALT_KEY_HEADERS)


def _scan(
    headers: Any,
) -> tuple[str, bytes, str, str | None, bytes, int | None, bool, bool, bool]:
    """:path (no query), the query, :method, the API key (`gateway.apikey`), x-request-id,
    content-length, whether a Content-Encoding other than identity compresses the body,
    whether it is a multipart form, and whether it is declared a urlencoded one
    (`gateway.request.scan_headers`, the HTTP edge's)."""
    path, query, method, req_id, declared, encoded = "", b"", "", b"", None, False
    multipart = form = False
    keys: KeyScan | None = None
    for h in headers:
        key = h.key
        if key == ":path":
            raw, _, query = h.raw_value.partition(b"?")
            path = raw.decode("latin-1")
        elif key == ":method":
            method = h.raw_value.decode("latin-1")
        elif key in _KEY_HEADERS:
            keys = keys or KeyScan()
            keys.add(key.encode("latin-1"), h.raw_value)
        elif key == "x-request-id":
            req_id = h.raw_value
        elif key == "content-length" and h.raw_value.isdigit():
            declared = int(h.raw_value)
        elif key == "content-encoding":
            encoded = encoded or h.raw_value.strip().lower() not in (b"", b"identity")
        elif key == "content-type":
            kind = h.raw_value.lstrip()[:33].lower()
            multipart = multipart or kind[:19] == b"multipart/form-data"
            form = form or kind == b"application/x-www-form-urlencoded"
    token = keys.key if keys is not None else None
    return path, query, method, token, req_id, declared, encoded, multipart, form
