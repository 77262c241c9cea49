"""vLLM's 500 for one request (an exception while serving it, not a dead engine) through the
picker, a real gRPC client playing Envoy's part: Envoy retries a 500 on the next endpoint of
the destination, and says which one answered. A request that fails alike wherever it runs
is its own fault, not its replicas'."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct

from gateway.epp.wire import DESTINATION
from tests.support.epp import EppProc, epp_proc
from tests.support.gateway import metric_values
from tests.support.procs import Proc, start_sims

PUBLIC, SERVED = "public-model", "sim-model"
INTERNAL = (b'{"error":{"message":"list index out of range","type":"InternalServerError",'
            b'"param":null,"code":500}}')
OK = b'{"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'


def _picker(replicas: int, fallbacks: int) -> Iterator[EppProc]:
    procs: list[Proc] = []
    try:
        _, urls = start_sims(procs, replicas, "--time-scale", "20", model=SERVED)
        epp = epp_proc(config={"pools": {"p": {"served_model": SERVED, "replicas": urls}},
                               "models": {PUBLIC: {"default": "p"}},
                               "epp": {"fallbacks": fallbacks}})
        procs.append(epp.start())
        yield epp
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture
def two() -> Iterator[EppProc]:
    yield from _picker(2, 1)


@pytest.fixture
def one() -> Iterator[EppProc]:
    yield from _picker(1, 0)


def _headers(pairs: dict[str, str], end: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(end_of_stream=end, headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


async def _exchange(epp: EppProc, status: int, reply: bytes, *, retried: bool,
                    stream: bool = False) -> int:
    """One request picked and answered `status` with `reply` (`stream`: an event stream),
    by the destination's second endpoint after Envoy's retry (`retried`) or by its first;
    the status the client got."""
    body = orjson.dumps({"model": PUBLIC, "max_tokens": 2, "stream": stream,
                         "messages": [{"role": "user", "content": "the same poison"}]})
    async with grpc.aio.insecure_channel(epp.picker) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(pb.ProcessingRequest(request_headers=_headers({
            ":method": "POST", ":path": "/v1/chat/completions",
            "content-type": "application/json", "content-length": str(len(body))})))
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=body, end_of_stream=True)))
        head = await asyncio.wait_for(call.read(), 10)
        if head.HasField("immediate_response"):  # no replica takes requests: a 503
            return int(head.immediate_response.status.code)
        await asyncio.wait_for(call.read(), 10)
        mutation = head.request_headers.response.header_mutation
        destination = next(h.header.raw_value.decode() for h in mutation.set_headers
                           if h.header.key == DESTINATION).split(",")
        served = Struct()
        served.update({"x-gateway-destination-endpoint-served":
                       destination[1] if retried else destination[0]})
        await call.write(pb.ProcessingRequest(
            response_headers=_headers({":status": str(status), "content-type":
                                       "text/event-stream" if stream else "application/json"}),
            metadata_context=Metadata(filter_metadata={"envoy.lb": served})))
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(
            body=reply, end_of_stream=True)))
        answer: Any = await asyncio.wait_for(call.read(), 10)
        await call.done_writing()
    code = answer.response_headers.response.header_mutation.set_headers
    return next((int(h.header.raw_value) for h in code if h.header.key == ":status"), status)


def _failures(epp: EppProc) -> float:
    return sum(metric_values(epp.base, "kvgate_replica_failures_total").values())


def _healthy(epp: EppProc) -> float:
    return sum(metric_values(epp.base, "kvgate_replica_healthy").values())


async def test_a_500_on_both_endpoints_envoy_tried_is_charged_to_neither(two: EppProc) -> None:
    """Every endpoint Envoy went past was charged a failure, and the one that answered the
    same 500 too: three such requests (a client and its SDK's retries) charged each replica
    three failures and ejected the pool whole."""
    for _ in range(3):
        assert await _exchange(two, 500, INTERNAL, retried=True) == 500
    assert _failures(two) == 0 and _healthy(two) == 2


async def test_the_endpoint_envoy_went_past_is_charged_when_the_next_one_serves(
    two: EppProc,
) -> None:
    assert await _exchange(two, 200, OK, retried=True) == 200
    assert _failures(two) == 1


async def test_a_500_on_a_pools_only_replica_does_not_eject_it(one: EppProc) -> None:
    """As on the HTTP edge: no other replica could try it, so nothing says whose fault it is;
    charged, it ejected the pool's only replica. Counted (the doctor names a replica failing
    every request), not charged to its health."""
    for _ in range(3):
        assert await _exchange(one, 500, INTERNAL, retried=False) == 500
    assert _failures(one) == 3 and _healthy(one) == 1


ERROR_EVENTS = {
    "before-output": b"",
    "mid-stream": b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n',
}


@pytest.mark.parametrize("before", list(ERROR_EVENTS), ids=list(ERROR_EVENTS))
async def test_a_streams_error_event_on_a_pools_only_replica_does_not_eject_it(
    one: EppProc, before: str,
) -> None:
    """The streamed counterpart (vLLM's error event of code 500, not a dead engine's): it was
    charged to the pool's only replica, and three of them ejected it."""
    event = (b'data: {"error":{"message":"list index out of range","type":'
             b'"InternalServerError","param":null,"code":500}}\n\ndata: [DONE]\n\n')
    for _ in range(3):
        await _exchange(one, 200, ERROR_EVENTS[before] + event, retried=False, stream=True)
    assert _failures(one) == 3 and _healthy(one) == 1  # counted, not charged
