"""What differs per vLLM route (`gateway.vllm_routes`), kvgate's errors in Anthropic's shape
(`gateway.anthropic_errors`), and the stream scanner's end of an Anthropic stream."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.anthropic_errors import anthropic_stream, anthropic_type, error_body
from gateway.asgi import Message
from gateway.body import ParsedBody, parse_body
from gateway.errors import AuthError, BadRequest, NoReplicaAvailable
from gateway.sse import StreamScanner
from gateway.stream_end import error_event, stream_error
from gateway.vllm_routes import PRIORITIZED, SALTED, VLLM_KINDS, adapt, chat_view
from routing.config import RouterConfig
from routing.features import extract_features


def _parsed(kind: str, body: dict[str, object]) -> ParsedBody:
    parsed = parse_body(orjson.dumps({"model": "m", **body}), kind)
    adapt(parsed, kind)
    return parsed


def test_a_message_body_reads_as_chat_with_its_system_prompt_first() -> None:
    body = {"system": [{"type": "text", "text": "be terse"}], "max_tokens": 9,
            "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "t"}]}
    view = chat_view(body)
    assert view["messages"][0] == {"role": "system", "content": body["system"]}
    assert view["messages"][1:] == body["messages"]
    assert (view["tools"], view["max_tokens"]) == ([{"name": "t"}], 9)
    assert "system" in body  # (the body sent on is not changed)


def test_messages_sharing_system_and_turns_share_block_hashes_and_others_do_not() -> None:
    config = RouterConfig(block_chars=16)
    system = "You are a careful assistant. " * 8

    def hashes(system_prompt: str, turn: str) -> tuple[int, ...]:
        view = chat_view({"system": system_prompt,
                          "messages": [{"role": "user", "content": turn}]})
        return extract_features(view, model="m", salt="s", config=config).block_hashes

    one, two = hashes(system, "first question"), hashes(system, "second question")
    assert one[:4] == two[:4]
    assert hashes("Another system prompt entirely. " * 8, "first question")[0] != one[0]


def test_the_prompt_estimate_counts_system_and_messages() -> None:
    short = _parsed("messages", {"messages": [{"role": "user", "content": "hi"}]})
    longer = _parsed("messages", {"system": "x" * 400,
                                  "messages": [{"role": "user", "content": "hi"}]})
    assert longer.prompt_tokens >= short.prompt_tokens + 90
    assert longer.generates


@pytest.mark.parametrize(("kind", "body"), [
    ("rerank", {"query": "q" * 40, "documents": ["d" * 40, {"text": "e" * 40}]}),
    ("score", {"text_1": "a" * 40, "text_2": ["b" * 40, "c" * 40]}),
    ("classify", {"input": ["a" * 80, "b" * 40]}),
    ("pooling", {"input": "a" * 120}),
    ("tokenize", {"prompt": "a" * 120}),
])
def test_pooling_and_tokenizer_bodies_count_their_text_and_generate_nothing(
    kind: str, body: dict[str, object],
) -> None:
    parsed = _parsed(kind, {**body, "stream": True, "max_tokens": 500})
    assert 25 <= parsed.prompt_tokens <= 40  # ~120 characters
    assert not parsed.generates and not parsed.stream


def test_a_streamed_message_stays_a_stream() -> None:
    assert _parsed("messages", {"stream": True, "messages": []}).stream


def test_count_tokens_with_stream_true_is_not_read_as_a_stream() -> None:
    """count_tokens answers whole: its `"stream": true` made the routing features (and the
    replica's in-flight accounting at both edges) count it as a stream."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    def streams(kind: str) -> bool:
        view = chat_view(body, kind)
        return extract_features(view, model="m", salt="", config=RouterConfig()).stream

    assert (streams("count_tokens"), streams("messages")) == (False, True)
    assert _parsed("count_tokens", body).stream is False


def test_salt_and_priority_go_only_where_vllm_has_the_field() -> None:
    kinds = set(VLLM_KINDS.values())
    assert kinds & SALTED == {"messages", "pooling", "classify", "score", "rerank"}
    assert kinds & PRIORITIZED == {"messages"}
    assert {"chat", "completions", "responses", "embeddings"} <= SALTED & PRIORITIZED


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (401, "authentication_error"),
    (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"),
    (503, "overloaded_error"), (502, "api_error"), (504, "api_error"),
    (409, "invalid_request_error"),
])
def test_anthropic_error_types(status: int, kind: str) -> None:
    assert anthropic_type(status) == kind


def test_error_bodies_take_the_routes_shape() -> None:
    exc = AuthError("No key.")
    assert orjson.loads(error_body("/v1/messages", exc)) == {
        "type": "error", "error": {"type": "authentication_error", "message": "No key."}}
    assert orjson.loads(error_body("/v1/messages/count_tokens", BadRequest("x")))["type"] == \
        "error"
    busy = NoReplicaAvailable("busy", retry_after=3)
    assert error_body("/v1/rerank", busy) == busy.body()  # OpenAI's shape elsewhere
    assert orjson.loads(error_body("/v1/chat/completions", busy))["error"]["message"] == "busy"


def _fed(*chunks: bytes) -> StreamScanner:
    scanner = StreamScanner(strip_usage=False)
    for chunk in chunks:
        scanner.feed(chunk)
    return scanner


def test_an_anthropic_stream_ending_with_message_stop_is_complete() -> None:
    start = b'event: message_start\ndata: {"type":"message_start","message":{}}\n\n'
    delta = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
             b'"delta":{"type":"text_delta","text":"hi"}}\n\n')
    stop = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert _fed(start, delta, stop).complete()
    assert not _fed(start, delta).complete()  # cut before its end: not whole


def test_an_anthropic_streams_usage_counts_its_prompt_and_its_output() -> None:
    start = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
             b'{"input_tokens":12,"output_tokens":0}}}\n\n')
    delta = (b'event: message_delta\ndata: {"type":"message_delta","delta":{},'
             b'"usage":{"output_tokens":5}}\n\n')
    assert _fed(start, delta).usage == {"prompt_tokens": 12, "completion_tokens": 5}


def _through_anthropic_stream(*bodies: bytes) -> list[bytes]:
    sent: list[Message] = []

    async def collect(message: Message) -> None:
        sent.append(message)

    async def run() -> None:
        send = anthropic_stream(collect)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for body in bodies:
            await send({"type": "http.response.body", "body": body, "more_body": True})

    asyncio.run(run())
    return [m["body"] for m in sent[1:]]


def test_kvgates_own_stream_ending_becomes_anthropics_error_event() -> None:
    event = b'event: message_start\ndata: {"type":"message_start","message":{}}\n\n'
    ending = stream_error("The upstream replica failed mid-stream.")
    got = _through_anthropic_stream(event, b": keep-alive\n\n" + ending)
    assert got[0] == event  # the replica's events pass untouched
    assert got[1].startswith(b": keep-alive\n\n")
    assert b"[DONE]" not in got[1]
    name, data = got[1].split(b"\n\n")[1].split(b"\n")
    assert name == b"event: error"
    assert orjson.loads(data.removeprefix(b"data: ")) == {"type": "error", "error": {
        "type": "api_error", "message": "The upstream replica failed mid-stream."}}
    timeout = stream_error("No answer in time.", "GatewayTimeoutError", 504)
    assert b'"api_error"' in _through_anthropic_stream(timeout)[0]
    busy = stream_error("Shutting down.", "ServiceUnavailableError", 503)
    assert b'"overloaded_error"' in _through_anthropic_stream(busy)[0]


def test_a_replicas_anthropic_error_as_the_last_event_is_named() -> None:
    body = b'{"type":"error","error":{"type":"overloaded_error","message":"busy"}}'
    _, last = error_event(529, body)
    got = _through_anthropic_stream(last)[0]
    assert got.startswith(b"event: error\ndata: " + body) and b"[DONE]" not in got


def test_text_that_looks_like_an_error_line_is_not_touched() -> None:
    delta = (b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":'
             b'{"type":"text_delta","text":"data: {\\"error\\": 1}\\ndata: [DONE]"}}\n\n')
    assert _through_anthropic_stream(delta) == [delta]
