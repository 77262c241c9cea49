"""The endpoint picker's Anthropic shapes: a local reply (Envoy's or a filter's) on an
Anthropic route re-shaped as Anthropic's error, and a stream's bytes with kvgate's own ending
rewritten as Anthropic's ``event: error`` while the replica's events pass unchanged."""

from __future__ import annotations

import orjson

from gateway.anthropic_errors import as_anthropic_events
from gateway.epp.local_reply import local_error
from gateway.stream_end import stream_error


def test_a_local_reply_on_messages_is_anthropic_shaped() -> None:
    body = local_error(503, b"no healthy upstream", "/v1/messages")
    assert body is not None
    assert orjson.loads(body) == {"type": "error", "error": {
        "type": "overloaded_error", "message": "no healthy upstream"}}
    openai = local_error(503, b"no healthy upstream", "/v1/chat/completions")
    assert openai is not None and orjson.loads(openai)["error"]["code"] == 503


def test_only_kvgates_own_stream_ending_is_rewritten() -> None:
    replica = b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n'
    assert as_anthropic_events(replica) == replica
    ended = as_anthropic_events(replica + stream_error("The stream was cut short."))
    assert ended.startswith(replica) and b"[DONE]" not in ended
    last = ended.strip().split(b"\n\n")[-1].split(b"\n")
    assert last[0] == b"event: error"
    assert orjson.loads(last[1].removeprefix(b"data: "))["error"] == {
        "type": "api_error", "message": "The stream was cut short."}
