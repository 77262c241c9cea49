"""Who ends an ext_proc stream the picker answered with an immediate response: Envoy.

Envoy makes its local reply from the immediate response and resets the stream. The picker
used to send the stream's gRPC status as soon as the answer was out, so the status often
started on a call Envoy had already cancelled, and grpcio leaks such a failed batch's native
memory (grpc/grpc issue 43360): ~0.7 KiB per request refused at its headers through Envoy
(`loadtest/results/bench_epp.md`). The picker now settles the exchange at once and leaves
the stream open until Envoy ends it: a reset ends it without a status, a half-close gets the
status OK at once.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from gateway.epp.server import ENDED_WAIT_S
from tests.support.epp import EppProc, epp_proc
from tests.support.gateway import request_statuses, wait_for
from tests.support.procs import sim_proc

MODEL = "sim-model"


@pytest.fixture(scope="module")
def picker() -> Iterator[EppProc]:
    sim, url = sim_proc(None, model=MODEL)
    with sim:
        epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}})
        with epp:
            yield epp


@pytest.fixture
async def stub(picker: EppProc) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    async with grpc.aio.insecure_channel(picker.picker) as channel:
        yield pb_grpc.ExternalProcessorStub(channel)


async def _refused(stub: pb_grpc.ExternalProcessorStub) -> grpc.aio.StreamStreamCall:
    """An exchange refused at its headers (a body declared past `server.max_body_bytes`:
    413); its answer read."""
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v) for k, v in (
            (":method", b"POST"), (":path", b"/v1/chat/completions"),
            ("content-type", b"application/json"), ("content-length", b"900000000"))]))))
    answer = await asyncio.wait_for(call.read(), 10)
    assert answer.immediate_response.status.code == 413
    return call


def _refusals(picker: EppProc) -> float:
    return request_statuses(picker.base).get("413", 0.0)


async def test_the_stream_stays_open_for_envoy_to_end_it(
    picker: EppProc, stub: pb_grpc.ExternalProcessorStub,
) -> None:
    before = _refusals(picker)
    call = await _refused(stub)
    status = asyncio.ensure_future(call.code())
    # the exchange is settled (counted) at once; the loop stays free to take the status
    await asyncio.to_thread(wait_for, lambda: _refusals(picker) == before + 1,
                            what="the 413 counted")
    later = await _refused(stub)  # a later answer on the same connection: a status sent
    later.cancel()  # with the first answer would have come before it
    assert not status.done(), "the status was sent before the stream's end"
    await call.done_writing()  # a data plane that half-closes gets the status at once
    # (well within the picker's own bound on the wait, `gateway.epp.server.ENDED_WAIT_S`: 30 s)
    assert await asyncio.wait_for(status, 10) == grpc.StatusCode.OK
    assert await asyncio.wait_for(call.read(), 10) == grpc.aio.EOF


async def test_a_reset_stream_ends_the_wait_and_the_picker_serves_on(
    picker: EppProc, stub: pb_grpc.ExternalProcessorStub,
) -> None:
    before = _refusals(picker)
    calls = [await _refused(stub) for _ in range(20)]
    for call in calls:
        call.cancel()  # as Envoy resets the stream after its local reply
    wait_for(lambda: _refusals(picker) == before + 20, what="each 413 counted once")
    call = await _refused(stub)
    await call.done_writing()
    assert await asyncio.wait_for(call.code(), 10) == grpc.StatusCode.OK
    assert _refusals(picker) == before + 21


async def test_the_picker_stops_without_waiting_for_answered_streams() -> None:
    """A stream answered with an immediate response and never ended by its data plane holds
    nothing, so the picker's stop does not wait for it: it waited out the whole shutdown
    grace (30.4 s with a 30 s grace, nothing in flight)."""
    sim, url = sim_proc(None, model=MODEL)
    with sim:
        epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}},
                               "server": {"shutdown_grace_s": 120}})
        with epp:
            async with grpc.aio.insecure_channel(epp.picker) as channel:
                call = await _refused(pb_grpc.ExternalProcessorStub(channel))  # left open
                epp.signal(signal.SIGTERM)
                # the picker ends the stream (status OK) at once, not after its own bound on
                # the wait (`ENDED_WAIT_S`, 30 s), and exits well within its grace
                assert await asyncio.wait_for(call.code(), ENDED_WAIT_S - 10) == grpc.StatusCode.OK
                assert epp.popen is not None
                assert await asyncio.to_thread(epp.popen.wait, 60) == 0, epp.output()
