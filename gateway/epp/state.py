"""What one exchange (`gateway.epp.exchange.Exchange`) holds, and what both of its sides use:
the core every exchange shares (`PickerCore`), the state of one ext_proc stream, its refusals
(OpenAI-shaped immediate responses) and its replica's lease."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.anthropic_errors import ANTHROPIC_PATHS, as_anthropic_events, error_body
from gateway.config import KvgateConfig
from gateway.epp import wire
from gateway.epp.modes import Misconfigured
from gateway.error_streaks import ErrorStreaks
from gateway.errors import KvgateError
from gateway.metrics import GatewayMetrics
from gateway.prepare import Preparer, unserved
from gateway.replicas import Lease, Replica
from gateway.request import ProxiedRequest, Uploads
from gateway.responses import ResponseStore
from gateway.sse import StreamScanner
from gateway.stored import StoredResponses
from gateway.tenancy.resolver import Principal
from gateway.tokenizer_info import TokenizerInfo
from routing.router import Router

Page = tuple[int, list[tuple[bytes, bytes]], bytes]

__all__ = ["ExchangeState", "Page", "PickerCore", "endpoint", "replica_key"]


@dataclass(frozen=True, slots=True)
class PickerCore:
    """What every exchange shares: the gateway's started core and the picker's settings."""

    cfg: KvgateConfig
    prep: Preparer
    router: Router
    metrics: GatewayMetrics
    responses: ResponseStore
    clock: Callable[[], float]
    # GET pages kvgate answers itself (/v1/models ...: for the caller, once authenticated)
    page: Callable[[str, Principal | None], Page | None]
    stored: StoredResponses  # where a stored Responses-API response lives
    new_id: Callable[[], bytes]
    fallbacks: int  # endpoints after the first in the destination (0: the first only)
    # request bodies still arriving through Envoy, all exchanges together (as at the HTTP edge)
    uploads: Uploads
    streaks: ErrorStreaks  # the replicas' 500s for requests that failed alike elsewhere
    misconfigured: Misconfigured  # filter settings the picker cannot pick in (counted, said)
    tokenizer_info: TokenizerInfo  # vLLM's GET /tokenizer_info, answered by the picker itself


def endpoint(replica: Replica) -> str:
    """The replica as the data plane names it: ``ip:port`` (``[v6]:port``)."""
    host, _, port = replica.id.rpartition(":")
    return f"[{host}]:{port}" if ":" in host else replica.id


def replica_key(ep: str) -> str:
    """An ``ip:port`` / ``[v6]:port`` endpoint as a replica id (``v6:port``)."""
    return ep.replace("[", "").replace("]", "") if ep.startswith("[") else ep


class ExchangeState:
    """The state of one ext_proc stream (one HTTP request through Envoy); the sides of an
    exchange (`RequestSide`, `AnswerSide`, `Deadlines`) are mixins over it."""

    __slots__ = ("_buffered", "_chunks", "_core", "_cut", "_details", "_form", "_head", "_held",
                 "_held_bytes",
                 "_held_declared", "_held_retry", "_held_status", "_held_type", "_holds", "_last",
                 "_lease", "_opening", "_passed", "_path", "_pending",
                 "_principal", "_removed", "_req_id", "_scanner", "_sent_at", "_size", "_skipped",
                 "_slashed", "_started", "_stored", "_stream", "_subset", "_t0", "_taken",
                 "_want_id",
                 "order", "req", "sse", "wake")

    def __init__(self, core: PickerCore) -> None:
        self._core = core
        self.req: ProxiedRequest | None = None
        self._req_id = b""  # the answer's x-request-id (a stored response's: no `req`)
        # the route asked (canonical): the picker's own errors take its client's shape there
        # (Anthropic's on `/v1/messages`, as at the HTTP edge: `gateway.anthropic_errors`)
        self._path = ""
        self._principal: Principal | None = None
        self._subset: Collection[str] | None = None
        self._chunks: list[bytes] = []
        # the request body comes whole in one message (Envoy's BUFFERED mode, `modes`)
        self._buffered = False
        self._form = False  # the body is declared a urlencoded form (`curl -d`'s, JSON too)
        self._size = 0
        self._taken = 0  # ... of them counted in `PickerCore.uploads` while the rest arrives
        self.order: list[Replica] = []  # the destination: first choice, then fallbacks
        # the endpoints Envoy went past before the one that answered, not charged yet
        self._skipped: list[Replica] = []
        # ... charged, or not (vLLM's 500 for the request): asked for a connection once the
        # answer went out, marked down when they refuse it (`passed`)
        self._passed: list[Replica] = []
        self._lease: Lease | None = None
        self.sse = False
        self._scanner: StreamScanner | None = None
        # a whole (non-SSE) answer, held to its end (`upstream.max_answer_bytes` at most) and
        # answered then: judged, read, an error re-shaped
        self._held: list[bytes] | None = None
        self._held_bytes = 0
        self._held_status = 0
        self._held_type = ""  # ... and its content type
        self._held_declared = True  # ... and its content-length (else it is parsed: `cut_json`)
        self._held_retry: str | None = None  # the held answer's Retry-After, as sent
        # the replica's response headers Envoy is to remove (`answer_headers.removed`)
        self._removed: list[str] = []
        # who made the answer, as Envoy says (its response code details, `envoy_reply`)
        self._details: str | None = None
        self._stored: str | None = None  # a stored response's pool/replica (not judged)
        self._stream = False  # a stored response's GET with ?stream=true: an SSE answer or 502
        # a stream's head (proxied or stored), held until its first bytes
        self._head: list[wire.Header] | None = None
        # a stream's answer has started (its first token; a stored one's: its first bytes):
        # the first-byte timeout applies until then, the idle one after
        self._started = False
        # a Responses API stream's opening events (`preamble_only`), held until its first
        # output when `_holds` (not a background response's), as the HTTP edge holds them
        self._holds = False
        self._opening = b""
        self._want_id = False  # a Responses API stream's id not remembered yet
        # a stored response's request with a body (a cancel's): its destination, answered with
        # the body once it is in (bounded), so no replica answers before a 413
        self._pending: pb.ProcessingResponse | None = None
        # a proxied route asked with a trailing slash: the :path the replica gets instead
        self._slashed = b""
        # the upstream timeouts (`deadline`): when the request went to its replica, when its
        # stream last sent bytes (perf_counter), and whether the picker ended it for them
        self._t0 = 0.0  # the request's start (the total timeout's), a stored one's too
        self._sent_at = 0.0  # when it went to its replica (0: not yet)
        self._last = 0.0
        self._cut = False
        # what wakes the exchange to end it when its replica is found stalled or down before
        # it got anything (`_replica_cut`; `server.py`: Envoy tells the picker nothing while
        # the replica sends no head)
        self.wake: Callable[[], None] | None = None

    @property
    def begun(self) -> bool:
        """Its request's headers have come (Envoy sends them once per stream)."""
        return self._t0 != 0.0

    def _uploaded(self) -> None:
        """The body is in (or never will be): its bytes no longer count as arriving."""
        if self._taken:
            self._core.uploads.give(self._taken, Uploads.owner(self.req))
            self._taken = 0

    def _refuse(self, exc: KvgateError) -> pb.ProcessingResponse:
        headers = [(k.decode(), v) for k, v in exc.headers()]
        if self.req is not None:
            self.req.status = exc.status
            if unserved(self.req):  # given back when the exchange closes (`Preparer.finish`)
                self.req.settled_headers(served=False)
            headers += [(k.decode(), v) for k, v in self.req.extra]
        if self._req_id:  # a proxied or stored request's (not kvgate's own pages)
            headers.append(("x-request-id", self._req_id))
        body = error_body(self._path, exc)
        return wire.immediate(exc.status, body, headers, f"kvgate_{exc.type_}")

    def _ending(self, events: bytes) -> bytes:
        """A stream's bytes the picker adds or passes: its own ending (an error event,
        ``[DONE]``) in Anthropic's ``event: error`` on the Anthropic routes, as the HTTP edge
        sends it (the SDK raises there; it skips OpenAI's as unknown events)."""
        return as_anthropic_events(events) if self._path in ANTHROPIC_PATHS else events

    # -- the replica's lease ---------------------------------------------------------------
    def _attach(self, replica: Replica) -> None:
        req = self.req
        assert req is not None
        req.replica, req.target = replica.id, replica
        req.attempts += 1
        self._lease = replica.acquire(
            req.features.prompt_tokens, req.features.stream, self._core.clock())
        self._lease.on_stall(self._replica_cut)  # its engine stops, it is found down: ended
        self._core.router.record_route(replica.id, req.features, self._core.clock())

    def _replica_cut(self) -> None:
        """Its replica stalled or was found down by its health checks before the request got
        anything: the exchange is woken to end it (`Deadlines.replica_stalled`)."""
        if self.wake is not None:
            self.wake()

    def _detach(self) -> None:
        """End the current lease; unanswered, it was a failure on that replica."""
        lease, req = self._lease, self.req
        if lease is None or req is None or req.target is None:
            return
        if not lease.answered:
            self._core.router.record_failure(req.target.id, req.features, self._core.clock())
        lease.release()
        self._lease = None
