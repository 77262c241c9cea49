"""Every way an exchange ends gives its replica's in-flight count back, driven by a real gRPC
client playing Envoy's part (``envoy.service.ext_proc.v3.ExternalProcessor/Process``).

Envoy ends the stream once the request is done; which message comes last depends on the
filter's processing modes: the response body's end of stream, its trailers, or nothing (the
stream closed, or reset: the client left, Envoy's connection to the picker went). A data plane
that keeps the stream open after the answer's end (Envoy's own ``deferred_close_timeout``, a
data plane that closes late) must not keep the request in flight meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from tests.support.epp import EppProc, epp_proc
from tests.support.gateway import inflight, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
WHOLE = orjson.dumps({"id": "c1", "object": "text_completion", "model": MODEL,
                      "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                "total_tokens": 2}})
EVENTS = (b'data: {"id":"c1","object":"text_completion","model":"sim-model","choices":'
          b'[{"index":0,"text":"hi","finish_reason":null}]}\n\ndata: [DONE]\n\n')


@pytest.fixture(scope="module")
def picker() -> Iterator[EppProc]:
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, model=MODEL)
        procs.append(sim.start())
        epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}})
        procs.append(epp.start())
        yield epp
    finally:
        for proc in reversed(procs):
            proc.stop()


def _headers(pairs: dict[str, str], end: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(end_of_stream=end, headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


async def _picked(call: Any, stream: bool) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": stream})
    await call.write(pb.ProcessingRequest(request_headers=_headers({
        ":method": "POST", ":path": "/v1/completions", "content-type": "application/json",
        "content-length": str(len(body))})))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body,
                                                                   end_of_stream=True)))
    for _ in range(2):  # the destination, the body
        await asyncio.wait_for(call.read(), 30)


def _answer_head(stream: bool) -> pb.ProcessingRequest:
    kind = "text/event-stream" if stream else "application/json"
    return pb.ProcessingRequest(response_headers=_headers({":status": "200",
                                                           "content-type": kind}))


def _answer_body(stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(
        body=EVENTS if stream else WHOLE, end_of_stream=True))


async def _answered(call: Any, stream: bool, head: bool, trailers: bool) -> None:
    """The answer's messages as the filter's modes send them; the stream left open."""
    if head:
        await call.write(_answer_head(stream))
    body = _answer_body(stream)
    if trailers:
        body.response_body.end_of_stream = False
    await call.write(body)
    if trailers:
        await call.write(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))


Ending = Callable[[Any, bool], Awaitable[None]]


async def _half_closed(call: Any, stream: bool) -> None:
    await call.done_writing()


async def _cancelled(call: Any, stream: bool) -> None:
    call.cancel()


async def _after_head_cancelled(call: Any, stream: bool) -> None:
    await call.write(_answer_head(stream))
    await asyncio.sleep(0)  # (sent before the reset)
    call.cancel()


ENDINGS: dict[str, Ending] = {
    "body-eos": lambda call, stream: _answered(call, stream, head=True, trailers=False),
    "trailers": lambda call, stream: _answered(call, stream, head=True, trailers=True),
    "headers-skipped": lambda call, stream: _answered(call, stream, head=False,
                                                      trailers=False),
    "half-closed": _half_closed,
    "reset": _cancelled,
    "reset-after-head": _after_head_cancelled,
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_in_flight_is_given_back_however_the_exchange_ends(
    picker: EppProc, ending: str, stream: bool,
) -> None:
    async with grpc.aio.insecure_channel(picker.picker) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await _picked(call, stream)
        assert inflight(picker.base) == 1
        await ENDINGS[ending](call, stream)
        # the stream is left open (unless reset or half-closed): the answer's end ends it
        await asyncio.to_thread(wait_for, lambda: inflight(picker.base) == 0, 30,
                                "in-flight back to 0")
        call.cancel()


async def test_in_flight_is_given_back_when_the_connection_goes(picker: EppProc) -> None:
    channel = grpc.aio.insecure_channel(picker.picker)
    calls = [pb_grpc.ExternalProcessorStub(channel).Process() for _ in range(3)]
    for call in calls:
        await _picked(call, True)
    assert inflight(picker.base) == 3
    await channel.close()  # Envoy's connection to the picker gone, every stream on it
    await asyncio.to_thread(wait_for, lambda: inflight(picker.base) == 0, 30,
                            "in-flight back to 0")
