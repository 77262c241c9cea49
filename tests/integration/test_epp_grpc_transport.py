"""The picker's gRPC server as Envoy's gRPC client uses it, driven by a real gRPC client: a
body chunk larger than gRPC's default 4 MiB message bound, and HTTP/2 keepalive pings on the
connection while an exchange waits for its answer (a non-streamed generation sends nothing on
its exchange until its answer's head).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from gateway.epp.server import MESSAGE_ROOM
from gateway.epp.wire import DESTINATION
from tests.support.epp import EppProc, epp_proc
from tests.support.gateway import inflight, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
LIMIT = 8 * 1024 * 1024  # `server.max_body_bytes`'s default


@pytest.fixture(scope="module")
def picker() -> Iterator[EppProc]:
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(sim.start())
        epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}})
        procs.append(epp.start())
        yield epp
    finally:
        for proc in reversed(procs):
            proc.stop()


def _headers(pairs: dict[str, str]) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


def _chat(content: str, size: int = 0) -> bytes:
    """A chat request, padded with JSON whitespace to `size` bytes (a large body, a short
    prompt)."""
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                         "max_tokens": 2})
    return body[:-1] + b" " * (size - len(body)) + b"}"


async def _send(call: Any, body: bytes) -> None:
    """The request's headers, then its body in one chunk, as Envoy passes a body it holds."""
    await call.write(pb.ProcessingRequest(request_headers=_headers({
        ":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"})))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body,
                                                                   end_of_stream=True)))


async def _answers(call: Any, n: int) -> Sequence[pb.ProcessingResponse]:
    return [await asyncio.wait_for(call.read(), 60) for _ in range(n)]


async def test_a_body_chunk_past_grpcs_default_bound_is_picked_or_refused(
    picker: EppProc,
) -> None:
    # (a gRPC client's own default send bound is none; Envoy's is none either)
    async with grpc.aio.insecure_channel(picker.picker) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        body = _chat("large", 5_000_000)  # 5 MB: over 4 MiB, under the 8 MiB limit
        call = stub.Process()
        await _send(call, body)
        headers, first = await _answers(call, 2)
        mutation = headers.request_headers.response.header_mutation
        assert DESTINATION in {h.header.key for h in mutation.set_headers}
        assert first.request_body.response.body_mutation.streamed_response.body
        call.cancel()
        # past the limit, in one chunk: the HTTP edge's 413, not a gRPC error
        over = _chat("larger", LIMIT + MESSAGE_ROOM // 2)
        call = stub.Process()
        await _send(call, over)
        refused = (await _answers(call, 1))[0].immediate_response
        assert refused.status.code == 413
        assert orjson.loads(refused.body)["error"]["code"] == 413
    wait_for(lambda: inflight(picker.base) == 0, what="the exchanges settled")


async def test_keepalive_pings_leave_an_exchange_waiting_for_its_answer_open(
    picker: EppProc,
) -> None:
    # Envoy's `connection_keepalive` on the picker's cluster: a ping every second (gRPC's
    # server took one every 5 minutes without data; past 2 more it sent a GOAWAY
    # "too_many_pings" and dropped the connection, and the exchanges on it)
    options = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_timeout_ms", 20000),
               ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0)]
    async with grpc.aio.insecure_channel(picker.picker, options=options) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        await _send(call, _chat("a long generation"))
        await _answers(call, 2)  # the destination and the body
        await asyncio.sleep(6)  # the replica generates; nothing moves on the exchange
        answer = orjson.dumps({"id": "c", "object": "chat.completion", "model": MODEL,
                               "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                   "role": "assistant", "content": "ok"}}]})
        await call.write(pb.ProcessingRequest(response_headers=_headers({
            ":status": "200", "content-type": "application/json",
            "content-length": str(len(answer))})))
        await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=answer,
                                                                        end_of_stream=True)))
        head, body = await _answers(call, 2)
        assert head.HasField("response_headers")
        assert body.response_body.response.body_mutation.streamed_response.body == answer
        await call.done_writing()
    wait_for(lambda: inflight(picker.base) == 0, what="the exchange settled")
