"""The picker's gRPC server: ``envoy.service.ext_proc.v3.ExternalProcessor/Process`` and the
standard gRPC health service, on the event loop of a started gateway.

`EppApp` is the gateway (`GatewayApp`: tenancy, pools, discovery, health polling, scraping,
shared routing state, the admin API and /metrics on the HTTP port) with the gRPC server
started after it and stopped before it. One ext_proc stream is one request (`Exchange`).
Health answers ``liveness`` (the process answers), ``readiness`` and
``envoy.service.ext_proc.v3.ExternalProcessor`` (both: what ``/readyz`` says -- some pool
has a usable replica and tenancy state is loaded); the empty service name is liveness.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.app import GatewayApp, Page
from gateway.config import KvgateConfig
from gateway.drain import INTERRUPT_WAIT_S, interrupt_all, interrupt_waiting
from gateway.epp.exchange import Exchange, PickerCore
from gateway.epp.modes import OBSERVED, Misconfigured
from gateway.error_streaks import ErrorStreaks
from gateway.proxy import MODEL_PREFIX, MODELS
from gateway.request import Uploads
from gateway.runtime import Runtime
from gateway.tenancy.resolver import Principal
from gateway.tokenizer_info import TokenizerInfo

__all__ = [
    "EXT_PROC_SERVICE", "KEEPALIVE_MS", "KEEPALIVE_TIMEOUT_MS", "MAX_ENDED_WAITS", "MESSAGE_ROOM",
    "EppApp", "Processor", "grpc_options", "keepalive_ms",
]

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS, READINESS = "liveness", "readiness"
# what a client reaching the picker through Envoy may GET from kvgate itself
PUBLIC_PAGES = frozenset({"/v1/models", "/health", "/ping", "/version"})


class Processor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """ext_proc: each stream is one HTTP request through the data plane."""

    def __init__(self, core: PickerCore) -> None:
        self._core = core
        self._closing: set[asyncio.Task[None]] = set()
        self._waiting: set[asyncio.Queue[pb.ProcessingRequest | None]] = set()  # (`_ended`)
        self._stopping = False

    def stop_waiting(self) -> None:
        """The picker stops: the streams answered with an immediate response and left for
        Envoy to end (`_ended`) end now. They hold nothing (settled), yet a data plane that
        never ended them kept the gRPC server's stop waiting out its whole grace."""
        self._stopping = True
        for inbox in self._waiting:
            inbox.put_nowait(None)

    async def _ended(self, inbox: asyncio.Queue[pb.ProcessingRequest | None]) -> None:
        # past `MAX_ENDED_WAITS` streams left open by the data plane, the next returns at once
        # (grpcio's leak, below, is the lesser cost: each held stream is ~37 KB for up to
        # `ENDED_WAIT_S`, and a flood of refused requests must not hold memory without bound)
        if self._stopping or len(self._waiting) >= MAX_ENDED_WAITS:
            return
        self._waiting.add(inbox)
        try:
            await _ended(inbox)
        finally:
            self._waiting.discard(inbox)

    async def _until_ended(self, inbox: asyncio.Queue[pb.ProcessingRequest | None]) -> None:
        """Read a stream to its end, answering nothing more: one whose answer is over (its
        exchange settled), or one of a filter in observability mode (`modes.OBSERVED`: a pick
        would lease a replica the request never goes to, and Envoy drops the answers). The
        data plane ends it (or the picker stops: `stop_waiting`); returning first would send
        the stream's status on a call Envoy may be resetting (`_ended`)."""
        if self._stopping:
            return
        self._waiting.add(inbox)
        try:
            while await inbox.get() is not None:
                pass
        finally:
            self._waiting.discard(inbox)

    def _closed(self, closing: asyncio.Task[None]) -> None:
        self._closing.discard(closing)
        if not closing.cancelled() and (exc := closing.exception()) is not None:
            # (the handler awaiting it may have been cancelled: nobody else would see it)
            log.error("closing an exchange failed", exc_info=exc)

    async def drain(self) -> None:
        """Wait for the exchanges' ends still running (`Process`'s shielded close)."""
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    async def Process(
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.ProcessingResponse]:
        ex = Exchange(self._core)
        inbox: asyncio.Queue[pb.ProcessingRequest | None] = asyncio.Queue()
        ex.wake = lambda: inbox.put_nowait(_STALLED)  # (`ExchangeState._replica_cut`)
        reader = asyncio.create_task(_read(requests, inbox))
        closing: asyncio.Task[None] | None = None
        try:
            while True:
                msg = await _next(inbox, ex.deadline())
                if msg is None:
                    await reader  # a failed read fails the stream, as before
                    break
                if msg is _LATE or msg is _STALLED:  # an upstream timeout passed with no
                    # message from Envoy, or the replica was found stalled or down
                    out = ex.timed_out() if msg is _LATE else ex.replica_stalled()
                    for answer in out:
                        yield answer
                    if out and out[0].HasField("immediate_response"):
                        closing = self._close(ex)
                        await self._ended(inbox)
                        return
                    continue
                if msg.observability_mode:  # Envoy routes on without the picker's answers:
                    self._core.misconfigured("observability_mode", OBSERVED)  # no pick
                    await self._until_ended(inbox)
                    return
                kind = msg.WhichOneof("request")
                out = await _dispatch(ex, msg, kind, context)
                for answer in out:
                    yield answer
                if out and out[0].HasField("immediate_response"):
                    # Envoy answers the client and ends the exchange: settle it now, then
                    # let Envoy end the stream first (`_ended`)
                    closing = self._close(ex)
                    await self._ended(inbox)
                    return
                if kind == "response_trailers" or (
                        kind == "response_body" and msg.response_body.end_of_stream):
                    # the answer's last message: settled now (its replica's in-flight count
                    # given back), not when the data plane gets round to ending the stream
                    closing = self._close(ex)
                    await self._until_ended(inbox)
                    return
        finally:
            reader.cancel()
            await asyncio.shield(closing or self._close(ex))

    def _close(self, ex: Exchange) -> asyncio.Task[None]:
        """`ex.close()` as a task of its own: gRPC cancels `Process` when Envoy ends the
        stream, and may again while it closes (a cancelled close left the endpoints Envoy went
        past unprobed, and could leave a lease or an admission held)."""
        closing = asyncio.create_task(ex.close())
        self._closing.add(closing)
        closing.add_done_callback(self._closed)
        return closing


async def _dispatch(
    ex: Exchange, msg: pb.ProcessingRequest, kind: str | None,
    context: grpc.aio.ServicerContext,
) -> Sequence[pb.ProcessingResponse]:
    """One of Envoy's messages to its side of the exchange; the answers to send."""
    if not ex.begun and kind in ("request_body", "request_trailers"):
        # the request's body or trailers before its headers (out of order, or a filter whose
        # processing mode skips them): nothing to pick with, and no answer would come --
        # Envoy waited its `message_timeout`. (An answer may come first: Envoy's or an
        # earlier filter's local reply, its error re-shaped as a stored response's.)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{kind} before request_headers")
    if kind == "response_body":
        return await ex.response_body(msg)
    if kind == "request_body":
        return await ex.request_body(msg)
    if kind == "request_headers":
        if ex.begun:  # one request per stream: a second would orphan the first's lease and
            # admission (`close` settles the first now)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "request_headers sent twice on one stream")
        out = await ex.request_headers(msg)
        if not out and msg.request_headers.end_of_stream:
            out = await ex.decide(end=True)  # a POST without a body
        return out
    if kind == "response_headers":
        return await ex.response_headers(msg)
    if kind == "request_trailers":
        return await ex.request_trailers()
    if kind == "response_trailers":
        return await ex.response_trailers()
    return ()  # (nothing else is Envoy's to send)


_LATE = pb.ProcessingRequest()  # `_next`'s "the deadline passed first"
_STALLED = pb.ProcessingRequest()  # the replica stalled or was found down (`_replica_cut`)


async def _read(
    requests: AsyncIterator[pb.ProcessingRequest],
    inbox: asyncio.Queue[pb.ProcessingRequest | None],
) -> None:
    """Envoy's messages into `inbox` (None: the stream ended), so the exchange can wait for
    the next one with a deadline without cancelling a read of the gRPC stream."""
    try:
        async for msg in requests:
            inbox.put_nowait(msg)
    finally:
        inbox.put_nowait(None)


# how long a stream answered with an immediate response waits for Envoy to end it, and how
# many may wait at once (Envoy ends each within a moment: a handful wait under any load)
ENDED_WAIT_S = 30.0
MAX_ENDED_WAITS = 1024


async def _ended(inbox: asyncio.Queue[pb.ProcessingRequest | None]) -> None:
    """Wait (up to `ENDED_WAIT_S`) for Envoy to end a stream the picker answered with an
    immediate response: Envoy resets it once the local reply is made, and gRPC then cancels
    this handler. Returning first sends the stream's status, which then starts on a call
    Envoy has cancelled, and grpcio leaks that failed batch's native memory (grpc/grpc issue
    43360): ~0.7 KiB per request refused at its headers (`loadtest/results/bench_soak.md`).
    A data plane that half-closes instead is answered the status at once (None comes)."""
    try:
        async with asyncio.timeout(ENDED_WAIT_S):
            while await inbox.get() is not None:
                pass  # nothing after an immediate response is read
    except TimeoutError:
        pass


async def _next(
    inbox: asyncio.Queue[pb.ProcessingRequest | None], wait: float | None,
) -> pb.ProcessingRequest | None:
    """The next message, or `_LATE` when `wait` seconds pass first."""
    if wait is None:
        return await inbox.get()
    try:
        async with asyncio.timeout(wait):
            return await inbox.get()
    except TimeoutError:
        return _LATE


class Health(health_pb2_grpc.HealthServicer):  # type: ignore[misc]
    """gRPC health: liveness, readiness and the ext_proc service."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext,
    ) -> health_pb2.HealthCheckResponse:
        status = health_pb2.HealthCheckResponse
        if request.service in ("", LIVENESS):
            return status(status=status.SERVING)
        if request.service in (READINESS, EXT_PROC_SERVICE):
            return status(status=status.SERVING if self._ready() else status.NOT_SERVING)
        await context.abort(grpc.StatusCode.NOT_FOUND, "unknown service")
        raise AssertionError("unreachable")  # abort raises


class EppApp(GatewayApp):
    """The gateway with the endpoint picker's gRPC server on `epp.port`."""

    def __init__(
        self, cfg: KvgateConfig, clock: Callable[[], float] = time.monotonic,
        after_start: Callable[[GatewayApp], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(cfg, clock, after_start)
        self.grpc: grpc.aio.Server | None = None
        self.grpc_port = 0

    async def started(self, rt: Runtime, stack: AsyncExitStack) -> None:
        prefix, counter = os.urandom(8).hex(), itertools.count()
        core = PickerCore(
            cfg=self.cfg, prep=rt.proxy.prep, router=self.router, metrics=self.metrics,
            responses=rt.proxy.responses, clock=self.clock, page=self._public_page,
            stored=rt.proxy.stored,
            new_id=lambda: f"{prefix}{next(counter):016x}".encode(),
            fallbacks=self.cfg.epp.fallbacks,
            uploads=Uploads(self.cfg.server.max_pending_body_bytes,
                            self.cfg.server.max_body_bytes),
            streaks=ErrorStreaks(self.cfg.health.failure_threshold),
            misconfigured=Misconfigured(self.metrics.registry),
            tokenizer_info=TokenizerInfo(rt.proxy.prep, rt.pools, self.cfg.upstream,
                                         self.clock, self.cfg.server.replica_header),
        )
        server = grpc.aio.server(options=grpc_options(
            self.cfg.server.max_body_bytes, self.cfg.health.stall_after_s))
        processor = Processor(core)
        pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
        health_pb2_grpc.add_HealthServicer_to_server(Health(self.ready), server)
        address = f"{_grpc_host(self.cfg.server.host)}:{self.cfg.epp.port}"
        try:
            self.grpc_port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise RuntimeError(f"cannot listen on {address} (gRPC): {exc}") from None
        await server.start()
        self.grpc = server

        async def stop() -> None:  # streams in flight may finish, new ones are refused
            processor.stop_waiting()
            await _stop(server, self.cfg.server.shutdown_grace_s)
            await processor.drain()

        stack.push_async_callback(stop)
        log.info("endpoint picker listening", extra={"grpc": address})

    def ready(self) -> bool:
        return self._readyz()[0] == 200

    def _public_page(self, path: str, principal: Principal | None) -> Page | None:
        if path.startswith(MODEL_PREFIX) and path != MODEL_PREFIX:
            return self._model(path[len(MODEL_PREFIX):], principal)
        if path == MODELS:
            return self._models(principal)
        page = self._get.get(path) if path in PUBLIC_PAGES else None
        return page() if page is not None else None


async def _stop(server: grpc.aio.Server, grace_s: float) -> None:
    """Stop as the HTTP edge does (`gateway.drain`): a request queued in flow control is
    answered 503 at once, recorded "interrupted" (`interrupt_waiting`; one queued later, at
    the end of the grace: `interrupt_all`); what is in flight has the grace, then
    `INTERRUPT_WAIT_S` before gRPC cancels what is left (a cancelled one was Envoy's 503,
    "The endpoint picker is unavailable", logged 499)."""
    stopping = asyncio.ensure_future(server.stop(grace_s + INTERRUPT_WAIT_S))
    interrupt_waiting()
    await asyncio.wait([stopping], timeout=grace_s)
    if not stopping.done():
        interrupt_all()
    await stopping


# gRPC's own bound on a received message (4 MiB), kept as room above the body limit: a
# request body chunk up to `server.max_body_bytes` past it is refused 413, a response body
# chunk as large as before is taken
MESSAGE_ROOM = 4 * 1024 * 1024
# a ping to Envoy every 5 s on each connection, which is closed when one is not answered
# within 5 s; sooner where `health.stall_after_s` is shorter (`keepalive_ms`). At 20 s + 10 s
# a frozen Envoy held its exchanges -- their replicas' in-flight counts, their tenants'
# concurrency leases, which other Envoys' requests of the tenant were refused for -- up to
# 30 s; a ping costs a few dozen bytes, and an Envoy that cannot answer one in 5 s serves nothing
KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS = 5_000, 5_000


def keepalive_ms(stall_after_s: float | None) -> tuple[int, int]:
    """The picker's pings to Envoy: (interval, timeout) in ms. An Envoy frozen with requests
    in flight must be found before the replicas could be judged stalled for them: its
    requests' leases are held while the replica's token counters stand still (it finished
    the answer Envoy holds, or never got the request), which is the stall rule's evidence
    (`gateway.stall`) -- with `stall_after_s` 3 s, a frozen Envoy's request was ended as a
    504 and its healthy replica ejected. Both together take at most half of
    `stall_after_s` (5 s + 5 s at its 60 s default), so the exchange has ended (499) and
    its lease is gone well before; no stall judge (off): the default. A ping's answer is
    waited for 1 s at least (a busy Envoy's late answer would end live exchanges)."""
    if not stall_after_s:
        return KEEPALIVE_MS, KEEPALIVE_TIMEOUT_MS
    third = max(int(stall_after_s * 1000 / 3), 200)
    return min(KEEPALIVE_MS, third), min(KEEPALIVE_TIMEOUT_MS, max(third // 2, 1000))


def grpc_options(max_body_bytes: int, stall_after_s: float | None = None,
                 ) -> list[tuple[str, int]]:
    """The gRPC server's options. A body chunk may be as large as the body (how much a data
    plane passes at once follows its buffer limits): at gRPC's default 4 MiB bound a 5 MB
    chunk, under the 8 MiB `server.max_body_bytes`, failed its exchange with
    RESOURCE_EXHAUSTED (a gRPC error: Envoy's bare 500) instead of being served.
    Envoy's keepalive pings (``connection_keepalive`` on the picker's cluster) are taken at
    any rate, with or without streams open: gRPC answers a ping more often than every 5
    minutes with no data sent by a GOAWAY "too_many_pings" that ends the connection and
    every exchange on it (a non-streamed generation sends nothing on its exchange for its
    whole length). The picker pings Envoy too (`keepalive_ms`): an Envoy that stopped
    answering without closing the connection (frozen, its node or network gone) held its
    exchanges, their replicas' in-flight counts and their tenants' concurrency leases, for
    ever -- an exchange waiting for its answer sends nothing, so TCP never found it gone; its
    connection is now closed once a ping goes unanswered, its exchanges ended (499)."""
    every, wait = keepalive_ms(stall_after_s)
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_body_bytes + MESSAGE_ROOM),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", 0),  # (0: no limit)
        ("grpc.keepalive_time_ms", every),
        ("grpc.keepalive_timeout_ms", wait),
        ("grpc.http2.max_pings_without_data", 0),  # (default: 2, then no more pings)
        # (gRPC 1.5x's defaults: a ping waited 1 minute for its answer, and pings on a
        # connection sending no data went at most every 5 minutes)
        ("grpc.http2.ping_timeout_ms", wait),
        ("grpc.http2.min_sent_ping_interval_without_data_ms", every),
    ]


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
