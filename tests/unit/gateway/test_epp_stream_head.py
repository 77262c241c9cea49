"""The picker's hold of a proxied stream's head (gateway/epp/answer_side.py), message by message:
`ProxiedRequest.sse` says the head went out toward the client (as on the HTTP edge), and a
first read that fails is an immediate 502, with no first token learnt from it."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from typing import Any
from unittest.mock import AsyncMock, Mock

import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.config import KvgateConfig
from gateway.epp.exchange import Exchange
from gateway.error_streaks import ErrorStreaks
from gateway.replicas import HealthRules, Replica
from gateway.request import ProxiedRequest
from routing.types import RequestFeatures

GOOD = b'data: {"id": "c", "object": "chat.completion.chunk", "choices": []}\n\n'
ENGINE_ERROR = b'data: {"error": {"message": "x", "type": "InternalServerError", "code": 500}}\n\n'


def _exchange(url: str = "http://127.0.0.1:1") -> tuple[Exchange, ProxiedRequest, Any]:
    core: Any = SimpleNamespace(cfg=KvgateConfig(), router=Mock(), metrics=Mock(),
                                responses=Mock(), clock=lambda: 0.0, new_id=lambda: b"new",
                                streaks=ErrorStreaks(3))
    ex = Exchange(core)
    req = ex.req = ProxiedRequest("/v1/chat/completions", "chat", b"rid", 0.0)
    req.parsed = SimpleNamespace(stream=True)  # type: ignore[assignment]
    req.features = RequestFeatures(model="m", block_hashes=(), prompt_tokens=1)
    replica = Replica("p", url, HealthRules())
    # a pool with another replica taking requests: an error event here is charged and the
    # stream's head is a 502 (alone in its pool, it would be relayed uncharged)
    other = Replica("p", "http://127.0.0.1:2", HealthRules())
    req.pool = SimpleNamespace(replicas=[replica, other])  # type: ignore[assignment]
    ex.order = [replica]
    ex._attach(replica)
    ex._t0 = ex._sent_at = time.perf_counter()  # its headers came, it was sent (`decide`)
    return ex, req, core


def _head() -> pb.ProcessingRequest:
    headers = [(":status", b"200"), ("content-type", b"text/event-stream")]
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=HeaderMap(
        headers=[HeaderValue(key=k, raw_value=v) for k, v in headers])))


def _body(chunk: bytes, end: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end))


async def test_sse_is_set_when_the_head_goes_out_not_when_it_arrives() -> None:
    ex, req, core = _exchange()
    assert await ex.response_headers(_head()) == []  # held
    assert not req.sse
    assert await ex.response_body(_body(b": keep")) == ()  # half a comment: nothing to send yet
    assert not req.sse
    out = await ex.response_body(_body(b"-alive\n\n" + GOOD))
    assert out[0].HasField("response_headers") and req.sse
    core.router.record_first_token.assert_called_once()


async def test_a_first_read_with_an_error_event_is_an_immediate_502() -> None:
    ex, req, core = _exchange()
    await ex.response_headers(_head())
    out = await ex.response_body(_body(GOOD + ENGINE_ERROR + b"data: [DONE]\n\n", end=True))
    assert len(out) == 1 and out[0].immediate_response.status.code == 502
    # the replica's own words, as the HTTP edge's 502 keeps them
    assert orjson.loads(out[0].immediate_response.body)["error"]["message"] == (
        "The replica's answer was an error (500): x")
    assert not req.sse and req.status == 502
    core.router.record_first_token.assert_not_called()  # as the HTTP edge: not answered


async def test_an_exchange_ended_mid_stream_is_a_499_unless_the_stream_was_whole() -> None:
    """Envoy ends the exchange before the stream's end when the client leaves (or the replica
    broke the connection: Envoy does not say): the HTTP edge's 499, not the 200 the picker
    counted once the stream had started. A client leaving right at [DONE] may beat Envoy's
    end of stream: that stream was whole, a 200."""
    with socket.create_server(("127.0.0.1", 0)) as listening:  # the replica, still there
        url = f"http://127.0.0.1:{listening.getsockname()[1]}"
        for events, status in ((GOOD, 499), (GOOD + b"data: [DONE]\n\n", 200)):
            ex, req, core = _exchange(url)
            core.prep = Mock(finish=AsyncMock())
            await ex.response_headers(_head())
            await ex.response_body(_body(events))
            assert req.sse  # the head went out
            await ex.close()
            assert req.status == status
            core.prep.finish.assert_awaited_once()
            assert ex._lease is None  # released
            assert req.target is not None and not req.target.down


async def test_an_exchange_ended_mid_stream_by_a_dead_replica_is_its_502() -> None:
    """... but when nothing listens at the replica's address any more (a killed process), it
    broke the connection: marked down at once, a 502 (it was a 499 and stayed up until
    health polling found it, the next requests sent to it Envoy's connect failures)."""
    ex, req, core = _exchange()  # (nothing listens at port 1)
    core.prep = Mock(finish=AsyncMock())
    await ex.response_headers(_head())
    await ex.response_body(_body(GOOD))
    await ex.close()
    assert req.status == 502
    assert req.target is not None and req.target.down


# a Responses API stream's opening events, as vLLM sends them before the prefill
CREATED = (b'event: response.created\ndata: {"type": "response.created", "response": '
           b'{"id": "resp_1", "status": "in_progress", "output": []}}\n\n')
IN_PROGRESS = (b'event: response.in_progress\ndata: {"type": "response.in_progress", '
               b'"response": {"id": "resp_1", "status": "in_progress", "output": []}}\n\n')
DELTA = (b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", '
         b'"delta": "Hi"}\n\n')


async def _responses(background: bool = False) -> tuple[Exchange, ProxiedRequest, Any]:
    ex, req, core = _exchange()
    req.kind = "responses"
    req.parsed = SimpleNamespace(  # type: ignore[assignment]
        stream=True, data={"background": True} if background else {})
    ex._sent_at = ex._t0 = 1.0  # (sent: the timeouts apply)
    await ex.response_headers(_head())
    return ex, req, core


async def test_a_responses_streams_opening_events_are_held_until_its_first_output() -> None:
    """As on the HTTP edge (`Relay._pump`): `response.created`/`response.in_progress` are no
    first token -- nothing is learnt from them, the first-byte timeout still runs, the head
    and they go out with the first output (the picker learnt a near-zero TTFT from them,
    and the idle timeout replaced the first-byte one)."""
    ex, req, core = await _responses()
    assert await ex.response_body(_body(CREATED + IN_PROGRESS)) == ()
    assert not req.sse and ex._unanswered()
    core.router.record_first_token.assert_not_called()
    core.responses.remember.assert_not_called()
    out = await ex.response_body(_body(DELTA))
    assert out[0].HasField("response_headers") and req.sse and not ex._unanswered()
    assert b"".join(o.response_body.response.body_mutation.streamed_response.body
                    for o in out[1:]) == CREATED + IN_PROGRESS + DELTA
    core.router.record_first_token.assert_called_once()
    core.responses.remember.assert_called_once()  # (its id, from the held events)


async def test_a_background_responses_streams_opening_events_go_out_at_once() -> None:
    """A background response's opening events are relayed as they come (the replica runs it
    on anyway), still no first token: the first-byte timeout goes on."""
    ex, req, core = await _responses(background=True)
    out = await ex.response_body(_body(CREATED))
    assert out[0].HasField("response_headers") and req.sse
    assert ex._unanswered()
    core.router.record_first_token.assert_not_called()
    core.responses.remember.assert_called_once()


async def test_a_responses_stream_ending_after_its_opening_events_only_is_a_502() -> None:
    """Held opening events, then the end without a terminal event: not started, the HTTP
    edge's 502 JSON; ended whole (a terminal event), they go out with it."""
    ex, _, _ = await _responses()
    await ex.response_body(_body(CREATED))
    out = await ex.response_body(_body(b"", end=True))
    assert len(out) == 1 and out[0].immediate_response.status.code == 502
    failed = b'event: response.failed\ndata: {"type": "response.failed"}\n\n'
    ex, _, _ = await _responses()
    await ex.response_body(_body(CREATED))
    out = await ex.response_body(_body(failed, end=True))
    assert out[0].HasField("response_headers")
    assert b"".join(o.response_body.response.body_mutation.streamed_response.body
                    for o in out[1:]) == CREATED + failed


async def test_a_whole_answers_idle_clock_starts_at_its_head_and_each_chunk() -> None:
    """A proxied whole answer: once its head came, the idle timeout bounds the wait for each
    chunk of its body (`upstream.idle_timeout_s`, "between chunks once the answer has
    started"), not only the total one."""
    ex, req, _ = _exchange()
    req.parsed = SimpleNamespace(stream=False)  # type: ignore[assignment]
    ex._sent_at = ex._t0 = time.perf_counter()
    head = [(":status", b"200"), ("content-type", b"application/json")]
    await ex.response_headers(pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=HeaderMap(headers=[HeaderValue(key=k, raw_value=v) for k, v in head]))))
    idle = KvgateConfig().upstream.idle_timeout_s
    left = ex.deadline()
    assert left is not None and idle - 1 < left <= idle
    ex._last -= idle - 1  # a while later: a chunk restarts the clock
    assert await ex.response_body(_body(b'{"id": ')) == []
    left = ex.deadline()
    assert left is not None and idle - 1 < left <= idle
