"""One proxied request: its state object, and reading what it sent (headers and body).

Split from `proxy.py` so the hot path there reads as the sequence of steps it is.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

from gateway.apikey import BARE_KEY_HEADERS, bare_key, merge
from gateway.asgi import Message, Receive
from gateway.body import ParsedBody
from gateway.drain import interruptible
from gateway.errors import BodyTooLarge, ShutDownWhileUploading, UploadsFull
from gateway.multipart import Form
from gateway.pool import Pool
from gateway.replicas import Replica
from gateway.tenancy.limits import Admission
from gateway.tenancy.resolver import parse_bearer
from gateway.timeouts import Canceller
from routing.tokens import count_tokens
from routing.types import RequestFeatures

__all__ = ["Head", "ProxiedRequest", "Uploads", "rate_limit_headers", "read_body", "replica_id",
           "request_id", "scan_headers"]

_VISIBLE = re.compile(rb"[\x21-\x7e]+")  # a sane X-Request-Id's bytes (`request_id`)


class ProxiedRequest:
    """One proxied request's state (one object per request, slotted)."""

    ctl: Canceller
    features: RequestFeatures
    parsed: ParsedBody
    pool: Pool

    __slots__ = (
        "adm",
        "attempts",
        "busy_wait",
        "cors",
        "ctl",
        "extra",
        "features",
        "flow_done",
        "form",
        "key_hash",
        "kind",
        "opened_by",
        "parsed",
        "path",
        "peeked",
        "pool",
        "pool_name",
        "queued_s",
        "relayed",
        "replica",
        "req_id",
        "route",
        "spilled",
        "sse",
        "status",
        "streamed",
        "strip",
        "suspect",
        "suspect_answer",
        "t0",
        "target",
        "tenant",
        "tenant_id",
        "tier",
        "ttft",
        "up_id",
        "usage",
        "used",
    )

    def __init__(
        self, path: str, kind: str, req_id: bytes, t0: float, up_id: bytes | None = None,
    ) -> None:
        self.path, self.kind, self.req_id, self.t0 = path, kind, req_id, t0
        self.up_id = req_id if up_id is None else up_id  # the replica's (`replica_id`)
        self.route = "none"
        self.replica = "none"
        self.target: Replica | None = None  # the replica of the current attempt
        # a replica that answered it vLLM's 500 for a request (not its dead engine's), not yet
        # charged a failure: whose fault it was, the next try tells (`Proxy._forward`)
        self.suspect: Replica | None = None
        self.suspect_answer = b""  # its 500's body: the answer when no other try answers
        self.pool_name = "none"
        self.status = 0
        self.sse = False  # an SSE response has started toward the client
        self.opened_by: str | None = None  # the replica whose try sent the stream's head
        # an event of the answer reached the client (before it, only `: keep-alive` comments
        # may have: another replica can still answer the stream)
        self.relayed = False
        self.strip = False
        self.spilled = False
        self.tier = self.tenant = self.tenant_id = "none"
        self.key_hash: str | None = None  # its caller's key, hashed (`TenantGate.current`)
        self.attempts = 0
        # the soonest (s) a replica that answered it 429 takes it again (`relay.busy_wait`)
        self.busy_wait: int | None = None
        self.ttft: float | None = None  # seconds to the first content chunk sent (streams)
        self.usage: dict[str, int] | None = None  # upstream usage counts
        self.adm: Admission | None = None
        self.peeked = False  # its tenant's limits were checked before its body was read
        self.extra: list[tuple[bytes, bytes]] = []  # x-ratelimit-* on every answer
        # CORS headers on every answer (gateway/cors.py); a browser's requests only
        self.cors: Sequence[tuple[bytes, bytes]] = ()
        self.used: int | None = None  # prompt + completion tokens from upstream usage
        # characters of generated output relayed to the client (`gateway.sse.output_chars`),
        # counted while a TPM reservation or flow control's share may have to be settled
        # without usage (`spent_tokens`); else None
        self.streamed: int | None = None
        self.queued_s: float | None = None  # waited in flow control's queue, or a held pick
        # flow control counts the request against its tenant's share of the pool until this
        # is called (once, when the request is over)
        self.flow_done: Callable[[], None] | None = None
        # an audio route's form body (`gateway.multipart`): its Content-Type goes upstream
        # with it, its upstream body rewritten from it; None for a JSON body
        self.form: Form | None = None

    def own_time(self, now: float) -> float:
        """Seconds since it arrived spent in kvgate itself (`kvgate_overhead_seconds`): not
        those it waited in flow control's queue or for a held pick (`queued_s`)."""
        return now - self.t0 - (self.queued_s or 0.0)

    def settled_headers(self, served: bool = True) -> None:
        """`extra`'s x-ratelimit-* as they read once the admission is settled (OpenAI's
        remaining after the request): a whole answer's, sent after its settle (both edges);
        they showed the reservation (a ``max_tokens`` of 500 for an answer of 2 tokens).
        Not `served` (`prepare.unserved`): its request and tokens given back."""
        adm = self.adm
        if adm is None or not (adm.limit_tokens or not served):
            return
        if (tokens := self.settle_tokens() if served else 0) is not None:
            self.extra = rate_limit_headers(adm.settled_to(tokens, served=served))

    def settle_tokens(self) -> int | None:
        """Tokens to charge: real usage; 0 when nothing reached a replica; else (no usage: a
        client that left, a stream cut short, a replica's refusal or error, a timeout) the
        prompt estimate and the output relayed to the client so far, estimated alike
        (`routing.tokens`), never more than was reserved. The output reserved at admission
        never ran, or the replica dropped it when its connection closed: a chat UI's stop
        button left three streams of ``max_tokens`` 400 holding a 1,000 TPM budget for a
        minute. None: nothing to settle (no admission)."""
        if self.used is not None or self.replica == "none":
            return self.spent_tokens()
        if self.adm is None:
            return None
        return min(self.spent_tokens(), self.adm.reserved_tokens)

    def spent_tokens(self) -> int:
        """Tokens the request used: real usage; 0 when nothing reached a replica; else the
        prompt estimate and the output relayed so far (``streamed``, estimated alike). What
        TPM admission settles (`settle_tokens`) and flow control's fair share keeps
        (`gateway.flow.gate`): a stream stopped after its first event used its prompt and a
        few tokens, not the ``max_tokens`` it asked for."""
        if self.used is not None:
            return self.used
        if self.replica == "none":
            return 0
        # (a replica was tried: `parsed` is set)
        return self.parsed.prompt_tokens + count_tokens(self.streamed or 0)


def rate_limit_headers(adm: Admission) -> list[tuple[bytes, bytes]]:
    """An admission's x-ratelimit-* headers (its Retry-After goes with a refusal's error)."""
    return [(k.encode(), v.encode()) for k, v in adm.headers().items() if k != "retry-after"]


class Uploads:
    """The bytes of request bodies still arriving, all requests together, bounded
    (`server.max_pending_body_bytes`; 0: no bound): many slow uploads of up to
    `server.max_body_bytes` each held the gateway's memory without bound (40 of 7 MiB: +280 MB
    RSS), since a tenant's limits are checked only once its body is in. One tenant (`owner`)
    holds at most half of the bound, or one whole body (`body_limit`) when that is more: one
    tenant's slow uploads filled it, and every other tenant's bodies arriving in parts got the
    503 until they ended."""

    __slots__ = ("_by_owner", "_limit", "_share", "pending")

    def __init__(self, limit: int, body_limit: int = 0) -> None:
        self._limit = limit
        self._share = max(limit // 2, body_limit)
        self._by_owner: dict[str, int] = {}  # the pending bytes of each tenant holding some
        self.pending = 0

    def take(self, n: int, owner: str | None = None) -> None:
        if self._limit and self.pending + n > self._limit and self.pending:
            raise UploadsFull("The gateway is receiving too many request bodies at once; "
                              "retry shortly.")
        if owner is not None and self._limit:
            held = self._by_owner.get(owner, 0)
            if held and held + n > self._share:
                raise UploadsFull("This tenant is sending too many request bodies at once; "
                                  "retry shortly.")
            self._by_owner[owner] = held + n
        self.pending += n

    @staticmethod
    def owner(req: ProxiedRequest | None) -> str | None:
        """Whose share a request's body counts in: its tenant's with authentication on, None
        without (one tenant, no share; a stored response's GET/cancel: no `req`). Both
        edges: the Envoy edge's uploads filled the whole bound for every tenant."""
        return req.tenant_id if req is not None and req.key_hash is not None else None

    def give(self, n: int, owner: str | None = None) -> None:
        self.pending -= n
        if owner is not None and owner in self._by_owner:
            left = self._by_owner.pop(owner) - n
            if left > 0:
                self._by_owner[owner] = left


async def read_body(
    receive: Receive, limit: int, declared: int | None, uploads: Uploads | None = None,
    owner: str | None = None,
) -> bytes:
    """The whole body (413 past ``limit``); while it arrives in parts, its bytes count in
    ``uploads`` (a body whole in its first message, the common case, is not counted), as
    `owner`'s (the tenant's, with authentication on; None: one tenant, no share), and
    the end of the shutdown grace stops reading it with a 503 (`gateway.drain`)."""
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"The request body exceeds the limit of {limit} bytes.")
    stop = _UploadStop()  # (the first read too: a client may stall before its body)
    try:
        with interruptible(stop):
            chunk, more = _body_part(await receive(), 0, limit)
            if not more:
                return chunk
            return await _read_parts(receive, limit, chunk, uploads, owner)
    except asyncio.CancelledError:
        if not stop.fired:
            raise  # the client left while sending, or a real cancellation
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        raise ShutDownWhileUploading("The gateway is shutting down; the request body did "
                                     "not arrive in time.") from None


async def _read_parts(
    receive: Receive, limit: int, first: bytes, uploads: Uploads | None, owner: str | None,
) -> bytes:
    chunks = [first]
    size, taken, more = len(first), 0, True
    try:
        if uploads is not None:
            uploads.take(size, owner)
            taken = size
        while more:
            chunk, more = _body_part(await receive(), size, limit)
            size += len(chunk)
            if uploads is not None:
                uploads.take(len(chunk), owner)
                taken += len(chunk)
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        if taken:
            uploads.give(taken, owner)  # type: ignore[union-attr]  # (taken only with uploads)


def _body_part(msg: Message, size: int, limit: int) -> tuple[bytes, bool]:
    """One ``http.request`` message's bytes and whether more follow (413 once the body so
    far passes ``limit``; a client gone while sending cancels the read)."""
    if msg["type"] != "http.request":
        raise asyncio.CancelledError  # client left while sending
    chunk: bytes = msg.get("body", b"")
    if size + len(chunk) > limit:
        raise BodyTooLarge(f"The request body exceeds the limit of {limit} bytes.")
    return chunk, bool(msg.get("more_body", False))


class _UploadStop:
    """A body still arriving, registered with `gateway.drain`: at the end of the grace its
    read is cancelled and answered with a 503 (else the task is cancelled at exit, and the
    client gets a text/plain 500)."""

    __slots__ = ("_task", "fired")

    def __init__(self) -> None:
        self._task = asyncio.current_task()
        self.fired = False

    def fire(self, reason: str) -> None:
        if not self.fired and self._task is not None:
            self.fired = True
            self._task.cancel()


class Head(NamedTuple):
    """What the proxied routes read of a request's headers (`scan_headers`)."""

    req_id: bytes
    up_id: bytes  # the X-Request-Id its replica is sent (`replica_id`)
    declared: int | None  # Content-Length
    token: str | None  # the API key presented (`gateway.apikey`)
    origin: bytes | None  # a browser's request (gateway/cors)
    encoded: bool  # a Content-Encoding other than identity: the body is compressed
    multipart: bool  # Content-Type multipart/form-data: a file upload, never a JSON body
    form: bool  # Content-Type application/x-www-form-urlencoded (curl -d's, a JSON body too)


def scan_headers(headers: list[tuple[bytes, bytes]], new_id: Callable[[], bytes]) -> Head:
    """X-Request-Id (accepted when sane, else generated), the declared Content-Length, the
    API key, the `Origin`, and whether the body is compressed, a multipart form or declared
    a urlencoded one."""
    req_id = b""
    declared = None
    token = alt = None  # from Authorization; from api-key / x-api-key (`gateway.apikey`)
    origin = None
    encoded = multipart = form = False
    for key, value in headers:
        if key == b"x-request-id":
            req_id = value
        elif key == b"content-length" and value.isdigit():
            declared = int(value)
        elif key == b"authorization":  # inline, not `KeyScan`: every request has one
            token = merge(token, parse_bearer(value.decode("latin-1")))
        elif key in BARE_KEY_HEADERS:
            alt = merge(alt, bare_key(value))
        elif key == b"origin":
            origin = value
        elif key == b"content-encoding":
            encoded = encoded or value.strip().lower() not in (b"", b"identity")
        elif key == b"content-type":
            kind = value.lstrip()[:33].lower()
            multipart = multipart or kind[:19] == b"multipart/form-data"
            form = form or kind == b"application/x-www-form-urlencoded"
    own = request_id(req_id, new_id)
    return Head(own, replica_id(own, req_id, new_id), declared,
                token if token is not None else alt, origin, encoded, multipart, form)


def request_id(sent: bytes, new_id: Callable[[], bytes]) -> bytes:
    """The client's X-Request-Id when sane (1 to 128 visible ASCII characters), else a new
    one (both edges, on every answer). Spaces and tabs are not sane: the id goes into kvgate's
    request log, and in its text form (``key=value`` pairs) ``x tenant=other status=200``
    wrote fields of the client's choosing into the operator's log line."""
    if not sent or len(sent) > 128 or not _VISIBLE.fullmatch(sent):
        return new_id()
    return sent


def replica_id(req_id: bytes, sent: bytes, new_id: Callable[[], bytes]) -> bytes:
    """The X-Request-Id a replica is sent for the request (both edges). vLLM takes it for its
    own request id (the answer's ``id`` is ``chatcmpl-<it>``), and an engine from before vLLM
    made those unique inside refuses a request whose id one still running has ("Request id
    ... already running", a 400) or mixes their outputs. A client's id (`req_id` is `sent`)
    may be on two requests at once -- two clients, a retry with a fixed id, an SDK's parallel
    calls --: it goes with a new kvgate id appended (unique across processes: a random
    prefix), so it still leads the replica's logs; kvgate's own id is unique as it is."""
    return req_id + b"-" + new_id() if req_id == sent else req_id
