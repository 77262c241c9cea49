"""The picker's side of the ext_proc protocol, driven by a real gRPC client playing Envoy's
part: the cases a stock Envoy does not produce on demand (a body large enough to be
re-chunked, request trailers, the subset hint as the protocol's list, the served endpoint in
``envoy.lb`` metadata) and the gRPC health service.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
import httpx
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.epp.wire import CHUNK_BYTES, DESTINATION
from gateway.prepare import OFF_LOOP_BYTES
from gateway.stream_end import MALFORMED
from gateway.tenancy.resolver import INVALID_KEY
from tests.support.epp import EppProc, epp_proc
from tests.support.gateway import AUTH_SECRET, metric_values, wait_for
from tests.support.procs import Proc, sim_proc, start_sims

PUBLIC, SERVED = "public-model", "sim-model"


@pytest.fixture(scope="module")
def picker() -> Iterator[tuple[EppProc, list[str]]]:
    procs: list[Proc] = []
    try:
        _, urls = start_sims(procs, 2, "--time-scale", "20", model=SERVED)
        config = {"pools": {"p": {"served_model": SERVED, "replicas": urls}},
                  "models": {PUBLIC: {"default": "p"}}, "epp": {"fallbacks": 1},
                  "server": {"max_body_bytes": 400_000}}
        epp = epp_proc(config=config)
        procs.append(epp.start())
        yield epp, [u.removeprefix("http://") for u in urls]
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture
async def stub(picker: tuple[EppProc, list[str]]) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    async with grpc.aio.insecure_channel(picker[0].picker) as channel:
        yield pb_grpc.ExternalProcessorStub(channel)


def _headers(pairs: dict[str, str], end: bool = False) -> pb.HttpHeaders:
    return pb.HttpHeaders(end_of_stream=end, headers=HeaderMap(headers=[
        HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))


def _request(body: bytes, **extra: str) -> dict[str, str]:
    return {":method": "POST", ":path": "/v1/chat/completions", "content-type":
            "application/json", "content-length": str(len(body)), **extra}


def _subset(endpoints: Sequence[str]) -> Metadata:
    hint = Struct()
    hint.update({"x-gateway-destination-endpoint-subset": list(endpoints)})
    return Metadata(filter_metadata={"envoy.lb.subset_hint": hint})


def _chat(content: str, **extra: Any) -> bytes:
    return orjson.dumps({"model": PUBLIC, "messages": [{"role": "user", "content": content}],
                         "max_tokens": 2, **extra})


def _set(resp: pb.ProcessingResponse) -> dict[str, bytes]:
    mutation = resp.request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value for h in mutation.set_headers}


async def _answers(call: Any, n: int) -> list[pb.ProcessingResponse]:
    return [await asyncio.wait_for(call.read(), 10) for _ in range(n)]


async def _picked(stub: Any, body: bytes) -> tuple[Any, list[pb.ProcessingResponse]]:
    """A new exchange with ``body`` sent whole: the call and the picker's two answers."""
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers(_request(body))))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body,
                                                                   end_of_stream=True)))
    return call, await _answers(call, 2)


async def test_a_large_body_is_rewritten_and_rechunked(stub: Any, picker: Any) -> None:
    body = _chat("x" * 150_000, stream=True)
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers(_request(body))))
    for i in range(0, len(body), 50_000):  # Envoy streams the body in pieces
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(
            body=body[i:i + 50_000], end_of_stream=i + 50_000 >= len(body))))
    first = (await _answers(call, 1))[0]
    sent = _set(first)
    destination = sent[DESTINATION].decode()
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb[DESTINATION].string_value == destination  # header and metadata agree
    primary, fallback = destination.split(",")
    assert {primary, fallback} == set(picker[1])  # epp.fallbacks: 1
    assert first.request_headers.response.clear_route_cache
    assert "authorization" in first.request_headers.response.header_mutation.remove_headers
    length = int(sent["content-length"])
    chunks: list[pb.ProcessingResponse] = []
    while sum(len(c.request_body.response.body_mutation.streamed_response.body)
              for c in chunks) < length:
        chunks += await _answers(call, 1)
    streamed = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert all(len(s.body) <= CHUNK_BYTES for s in streamed) and len(streamed) >= 3
    assert [s.end_of_stream for s in streamed] == [False] * (len(streamed) - 1) + [True]
    upstream = orjson.loads(b"".join(s.body for s in streamed))
    assert len(b"".join(s.body for s in streamed)) == length
    assert upstream["model"] == SERVED  # the public name became the pool's served name
    assert upstream["stream_options"] == {"include_usage": True}
    await call.done_writing()


async def test_trailers_end_the_body(stub: Any) -> None:
    body = _chat("with trailers")
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers(_request(body))))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body)))
    await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    headers, chunk, trailers = await _answers(call, 3)
    assert DESTINATION in _set(headers)
    assert not chunk.request_body.response.body_mutation.streamed_response.end_of_stream
    assert trailers.HasField("request_trailers")
    await call.done_writing()


async def test_the_subset_list_and_an_empty_one(stub: Any, picker: Any) -> None:
    allowed = picker[1][1]
    for _ in range(4):
        body = _chat("subset")
        call = stub.Process()
        await call.write(pb.ProcessingRequest(request_headers=_headers(_request(body)),
                                              metadata_context=_subset([allowed])))
        await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body,
                                                                       end_of_stream=True)))
        headers = (await _answers(call, 1))[0]
        assert _set(headers)[DESTINATION].decode() == allowed  # no fallback outside it
        await call.done_writing()
    body = _chat("nowhere")
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers(_request(body)),
                                          metadata_context=_subset([])))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body,
                                                                   end_of_stream=True)))
    refused = (await _answers(call, 1))[0].immediate_response
    assert refused.status.code == 503
    assert orjson.loads(refused.body)["error"]["type"] == "ServiceUnavailableError"


async def test_the_served_endpoint_from_metadata_moves_the_request(
    stub: Any, picker: Any
) -> None:
    body = _chat("served elsewhere")
    call, (headers, _) = await _picked(stub, body)
    _, fallback = _set(headers)[DESTINATION].decode().split(",")
    served = Struct()
    served.update({"x-gateway-destination-endpoint-served": fallback})
    await call.write(pb.ProcessingRequest(
        response_headers=_headers({":status": "200", "content-type": "application/json"}),
        metadata_context=Metadata(filter_metadata={"envoy.lb": served})))
    reply = b'{"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=reply,
                                                                    end_of_stream=True)))
    head, body = await _answers(call, 2)  # a whole answer: its head is held to its end
    answer = head.response_headers.response.header_mutation
    added = {h.header.key: h.header.raw_value.decode() for h in answer.set_headers}
    assert added["x-kvgate-replica"] == f"p/{fallback}"
    assert added["x-kvgate-route"] == "retry"
    passed = body.response_body.response.body_mutation
    assert passed.streamed_response.body == reply and passed.streamed_response.end_of_stream
    await call.done_writing()


EVENT = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'


async def _stream_started(stub: Any, text: str) -> Any:
    """A streamed chat request picked, and its replica's 200 event-stream head sent (the
    picker answers it with the stream's first bytes)."""
    call, _ = await _picked(stub, _chat(text, stream=True))
    await call.write(pb.ProcessingRequest(response_headers=_headers(
        {":status": "200", "content-type": "text/event-stream"})))
    return call


async def _stream_body(call: Any) -> Any:
    """The first body the picker hands back after the held head (answered with it)."""
    head, body = await _answers(call, 2)
    assert head.HasField("response_headers")
    return body.response_body.response.body_mutation.streamed_response


async def test_a_stream_ended_early_gets_an_error_event(stub: Any) -> None:
    """A replica that ends a stream cleanly but before ``data: [DONE]`` (Envoy relays the end
    of its body as it came): the last body the picker hands back ends with an error event,
    and half an event held back is dropped (as the HTTP mode's relay)."""
    call = await _stream_started(stub, "cut short")
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(
        body=EVENT + b'data: {"id":"c","cho', end_of_stream=True)))
    last = await _stream_body(call)
    first, error, done = last.body.split(b"\n\n")[:3]
    assert first + b"\n\n" == EVENT and last.end_of_stream
    assert b"before it was complete" in error and done == b"data: [DONE]"
    await call.done_writing()


async def test_a_malformed_event_ends_the_stream_with_an_error_event(stub: Any) -> None:
    """An event whose data is neither JSON nor [DONE] once the stream has started: the events
    before it pass, then an error event and [DONE] instead of it, and the client's stream ends
    there (as on the HTTP edge, not when the replica's does); the rest of the replica's stream
    is dropped. (In the stream's first read it is a 502 JSON: test_edges_agree.)"""
    call = await _stream_started(stub, "malformed")
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=EVENT)))
    assert (await _stream_body(call)).body == EVENT  # the stream has started
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(
        body=EVENT + b"data: <html>502 Bad Gateway</html>\n\n" + EVENT)))
    (answer,) = await _answers(call, 1)
    sent = answer.response_body.response.body_mutation.streamed_response
    first, error, done = sent.body.split(b"\n\n")[:3]
    assert first + b"\n\n" == EVENT and sent.end_of_stream
    assert orjson.loads(error.removeprefix(b"data: "))["error"] == {
        "message": MALFORMED,
        "type": "BadGatewayError", "param": None, "code": 502}
    assert done == b"data: [DONE]" and sent.body.endswith(b"[DONE]\n\n")
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(body=EVENT)))
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(
        body=b"data: [DONE]\n\n", end_of_stream=True)))
    await call.done_writing()
    assert await asyncio.wait_for(call.read(), 10) == grpc.aio.EOF  # nothing more answered


async def test_envoys_plain_error_is_answered_in_openai_shape(stub: Any) -> None:
    """Envoy's own 503 (no upstream answered) reaches the client as an OpenAI error."""
    body = _chat("to a dead replica")
    call, _ = await _picked(stub, body)
    await call.write(pb.ProcessingRequest(response_headers=_headers(
        {":status": "503", "content-type": "text/plain", "content-length": "19"})))
    await call.write(pb.ProcessingRequest(response_body=pb.HttpBody(
        body=b"no healthy upstream", end_of_stream=True)))
    headers, answer = await _answers(call, 2)  # the headers wait for the body
    mutation = headers.response_headers.response.header_mutation
    added = {h.header.key: h.header.raw_value for h in mutation.set_headers}
    assert added["content-type"] == b"application/json" and added["retry-after"] == b"1"
    assert list(mutation.remove_headers) == ["content-length"]
    shaped = orjson.loads(answer.response_body.response.body_mutation.streamed_response.body)
    assert shaped["error"]["type"] == "ServiceUnavailableError"
    assert shaped["error"]["code"] == 503
    await call.done_writing()


async def test_oversized_and_unknown_requests_are_refused_at_once(stub: Any) -> None:
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers(
        _request(b"", **{"content-length": "500000"}))))
    too_big = (await _answers(call, 1))[0].immediate_response
    assert too_big.status.code == 413
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers(
        {":method": "GET", ":path": "/v1/unknown"}, end=True)))
    unknown = (await _answers(call, 1))[0].immediate_response
    assert unknown.status.code == 404
    assert orjson.loads(unknown.body)["error"]["type"] == "NotFoundError"
    call = stub.Process()  # a base URL without /v1: the hint the HTTP mode gives
    await call.write(pb.ProcessingRequest(request_headers=_headers(
        {":method": "POST", ":path": "/chat/completions"}, end=True)))
    hinted = (await _answers(call, 1))[0].immediate_response
    assert hinted.status.code == 404
    assert "Did you mean /v1/chat/completions?" in orjson.loads(hinted.body)["error"]["message"]


async def test_kvgates_pages_take_the_methods_the_http_edge_takes(stub: Any) -> None:
    """`POST /ping` (vLLM's, SageMaker's probe) is answered; another method on a page is 405
    with `Allow`, not the unknown path's 404."""
    answers = {}
    for method, path in (("POST", "/ping"), ("DELETE", "/ping"), ("DELETE", "/v1/models"),
                         ("POST", "/version")):
        call = stub.Process()
        await call.write(pb.ProcessingRequest(request_headers=_headers(
            {":method": method, ":path": path}, end=True)))
        answers[method, path] = (await _answers(call, 1))[0].immediate_response
    assert answers["POST", "/ping"].status.code == 200
    assert orjson.loads(answers["POST", "/ping"].body) == {"status": "ok"}
    for (_, path), answer in answers.items():
        if path == "/ping" and answer.status.code == 200:
            continue
        assert answer.status.code == 405, path
        allow = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}["allow"]
        assert allow == (b"GET, HEAD, POST" if path == "/ping" else b"GET, HEAD"), path
        assert orjson.loads(answer.body)["error"]["type"] == "MethodNotAllowedError"


async def test_grpc_health(picker: Any) -> None:
    # the failure cases above may have ejected a replica for a moment (FAST_HEALTH)
    wait_for(lambda: httpx.get(f"{picker[0].base}/readyz", timeout=5).status_code == 200,
             what="the picker ready again")
    async with grpc.aio.insecure_channel(picker[0].picker) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        for service in ("", "liveness", "readiness",
                        "envoy.service.ext_proc.v3.ExternalProcessor"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == serving, service
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await health.Check(health_pb2.HealthCheckRequest(service="other"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def _one_pool(tiers: dict[str, Any] | None = None, auth: bool = False) -> tuple[Proc, EppProc]:
    """A picker over one pool of one simulator serving `PUBLIC` (not started)."""
    sim, url = sim_proc(None, "--time-scale", "20", model=SERVED)
    config: dict[str, Any] = {"pools": {"p": {"served_model": SERVED, "replicas": [url]}},
                              "models": {PUBLIC: {"default": "p"}}}
    if tiers is not None:
        config["tiers"] = tiers
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET} if auth else None
    return sim, epp_proc(config=config, auth=auth, env=env)


async def _get(stub: Any, path: str, token: str) -> pb.ImmediateResponse:
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers(
        {":method": "GET", ":path": path, "authorization": f"Bearer {token}"}, end=True)))
    answer: pb.ImmediateResponse = (await _answers(call, 1))[0].immediate_response
    return answer


async def test_models_retrieve_answers_a_public_name(stub: Any) -> None:
    found = await _get(stub, f"/v1/models/{PUBLIC}", "x")
    assert found.status.code == 200 and orjson.loads(found.body)["id"] == PUBLIC
    missing = await _get(stub, "/v1/models/org/other", "x")
    assert missing.status.code == 404 and orjson.loads(missing.body)["error"]["param"] == "model"


async def test_models_list_needs_a_valid_key_when_authentication_is_on() -> None:
    sim, epp = _one_pool(auth=True)
    with sim, epp:
        async with grpc.aio.insecure_channel(epp.picker) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            refused = [await _get(stub, path, "kvg-not-a-key")
                       for path in ("/v1/models", f"/v1/models/{PUBLIC}")]
    for answer in refused:
        assert answer.status.code == 401
        assert orjson.loads(answer.body)["error"]["code"] == "invalid_api_key"
        assert PUBLIC.encode() not in answer.body


async def test_a_tenant_over_its_limit_is_refused_before_its_large_body() -> None:
    """As on the HTTP edge: a body declared at 128 KiB or more from a tenant over its limit
    is refused at its headers (429), before Envoy streams it to the picker."""
    sim, epp = _one_pool(tiers={"default": {"limits": {"rpm": 1}}})
    with sim, epp:
        async with grpc.aio.insecure_channel(epp.picker) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            body = _chat("the minute's one request")
            call = stub.Process()
            await call.write(pb.ProcessingRequest(request_headers=_headers(_request(body))))
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(
                body=body, end_of_stream=True)))
            assert DESTINATION in _set((await _answers(call, 1))[0])
            await call.done_writing()
            call = stub.Process()
            await call.write(pb.ProcessingRequest(request_headers=_headers(
                _request(b"", **{"content-length": str(OFF_LOOP_BYTES)}))))
            refused = (await _answers(call, 1))[0].immediate_response
    assert refused.status.code == 429
    assert orjson.loads(refused.body)["error"]["type"] == "RateLimitError"


async def test_request_headers_twice_fail_the_stream_and_settle_the_first_request() -> None:
    """Envoy sends one request's headers per stream. A second set (a broken data plane) used
    to replace the request in progress: its lease stayed in flight for ever and its tenant's
    concurrency slot was never returned (every later request a 429). The stream now fails
    (INVALID_ARGUMENT) and the first request is settled."""
    sim, epp = _one_pool(tiers={"default": {"limits": {"max_concurrency": 1}}})
    with sim, epp:
        async with grpc.aio.insecure_channel(epp.picker) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            body = _chat("once")
            call, answers = await _picked(stub, body)
            assert DESTINATION in _set(answers[0])
            await call.write(pb.ProcessingRequest(request_headers=_headers(_request(body))))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _answers(call, 1)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            wait_for(lambda: sum(metric_values(
                epp.base, "kvgate_inflight_requests").values()) == 0, what="nothing in flight")
            _, answers = await _picked(stub, body)  # the tenant's one slot is free again
            assert DESTINATION in _set(answers[0])


@pytest.mark.parametrize("first", [
    pb.ProcessingRequest(request_body=pb.HttpBody(body=_chat("early"), end_of_stream=True)),
    pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
], ids=["body", "trailers"])
async def test_a_message_before_the_request_headers_fails_the_stream_at_once(
    stub: Any, picker: Any, first: pb.ProcessingRequest,
) -> None:
    """A request's body or trailers come after its headers. Before them (a broken data
    plane, or a filter set to skip the headers) they were taken without an answer, and Envoy
    waited for its `message_timeout` (1000 s in the shipped bootstrap). The stream now fails
    at once (INVALID_ARGUMENT), nothing held."""
    call = stub.Process()
    await call.write(first)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _answers(call, 1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "before request_headers" in (err.value.details() or "")
    assert sum(metric_values(picker[0].base, "kvgate_inflight_requests").values()) == 0
    call, answers = await _picked(stub, _chat("after"))  # the picker serves on
    assert DESTINATION in _set(answers[0])
    call.cancel()


async def test_no_key_header_of_the_client_reaches_the_replica(stub: Any) -> None:
    """The picker strips the client's key, in whichever header it came (`gateway.apikey`),
    before Envoy sends the request on."""
    body = _chat("keys")
    call = stub.Process()
    await call.write(pb.ProcessingRequest(request_headers=_headers(_request(
        body, authorization="Bearer kvg-client", **{"api-key": "kvg-client",
                                                     "x-api-key": "kvg-client"}))))
    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body,
                                                                   end_of_stream=True)))
    answers = await _answers(call, 2)
    removed = {key for answer in answers for key in
               answer.request_headers.response.header_mutation.remove_headers}
    assert {"authorization", "api-key", "x-api-key"} <= removed
    call.cancel()


async def test_key_headers_are_read_as_on_the_http_edge() -> None:
    """A bare key in `api-key` is read (an unknown one is "invalid", not "missing"), and two
    different bearer keys are refused as such."""
    sim, epp = _one_pool(auth=True)
    with sim, epp:
        async with grpc.aio.insecure_channel(epp.picker) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            answers = []
            call = stub.Process()
            await call.write(pb.ProcessingRequest(request_headers=_headers(
                {":method": "GET", ":path": "/v1/models", "api-key": "kvg-not-a-key"},
                end=True)))
            answers.append((await _answers(call, 1))[0].immediate_response)
            call = stub.Process()  # Envoy passes a repeated header as repeated entries
            await call.write(pb.ProcessingRequest(request_headers=pb.HttpHeaders(
                end_of_stream=True, headers=HeaderMap(headers=[
                    HeaderValue(key=":method", raw_value=b"GET"),
                    HeaderValue(key=":path", raw_value=b"/v1/models"),
                    HeaderValue(key="authorization", raw_value=b"Bearer kvg-a"),
                    HeaderValue(key="authorization", raw_value=b"Bearer kvg-b")]))))
            answers.append((await _answers(call, 1))[0].immediate_response)
    messages = [orjson.loads(a.body)["error"]["message"] for a in answers]
    assert all(a.status.code == 401 for a in answers)
    assert messages[0] == INVALID_KEY
    assert "more than one API key" in messages[1]
