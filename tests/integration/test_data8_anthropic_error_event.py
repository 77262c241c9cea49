"""vLLM's error event on an Anthropic stream is an error, as its OpenAI one is.

vLLM's `/v1/messages` stream turns a failure (its engine dead before the first token, a chat
error event it cannot convert) into Anthropic's ``event: error`` with ``data: {"type":
"error", "error": {"type": "internal_error", ...}}``, then ``data: [DONE]``. kvgate read only
OpenAI's error events (``data: {"error": ...}``): on ``/v1/messages`` such a first event went
to the client as a started stream -- the Anthropic SDK raised at it -- where the same failure
on ``/v1/chat/completions`` is tried on another replica; and the stream counted as served
(status 200), the replica not charged. Now it is judged as the OpenAI error event is: before
anything reached the client, another replica answers.

A real gateway (round robin over two loopback replicas, one failing so), the official
anthropic client.
"""

from __future__ import annotations

import anthropic
import orjson

from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.gateway import gateway_proc, inflight, request_statuses, wait_for

MODEL = "m"


def _event(name: bytes, doc: dict[str, object]) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(doc) + b"\n\n"


FAILED_EVENT = _event(b"error", {"type": "error", "error": {
    "type": "internal_error", "message": "the engine failed"}})
FAILED = sse_head() + chunked(FAILED_EVENT, b"data: [DONE]\n\n")
STARTED = (
    _event(b"message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": MODEL,
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": 1, "output_tokens": 0}}}),
    _event(b"content_block_start", {"type": "content_block_start", "index": 0,
                                    "content_block": {"type": "text", "text": ""}}),
    _event(b"content_block_delta", {"type": "content_block_delta", "index": 0,
                                    "delta": {"type": "text_delta", "text": "hello"}}),
)
WHOLE = sse_head() + chunked(
    *STARTED,
    _event(b"content_block_stop", {"type": "content_block_stop", "index": 0}),
    _event(b"message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                              "usage": {"output_tokens": 1}}),
    _event(b"message_stop", {"type": "message_stop"}),
    b"data: [DONE]\n\n")


def test_an_anthropic_error_event_first_is_tried_on_another_replica() -> None:
    with BadReplica(MODEL, answer=FAILED) as bad, BadReplica(MODEL, answer=WHOLE) as good:
        gw, base = gateway_proc(upstreams=[bad.url, good.url], args=[
            "--policy", "round_robin"], env={"KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"})
        with gw:
            client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=30)
            for _ in range(4):  # round robin: the failing replica is asked first at least once
                with client.messages.stream(model=MODEL, max_tokens=5, messages=[
                        {"role": "user", "content": "hi"}]) as stream:
                    message = stream.get_final_message()
                assert message.content[0].type == "text"
                assert message.content[0].text == "hello"
            assert bad.posts >= 1
            wait_for(lambda: inflight(base) == 0, what="no request left in flight")


def test_an_anthropic_error_event_mid_stream_is_relayed_and_counted_as_the_error() -> None:
    with BadReplica(MODEL) as bad:
        bad.answer = sse_head() + chunked(*STARTED, last=False)
        bad.rest = chunked(FAILED_EVENT, b"data: [DONE]\n\n")  # once the client has "hello"
        gw, base = gateway_proc(upstreams=[bad.url], env={
            "KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"})
        with gw:
            client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=30)
            texts = []
            try:
                with client.messages.stream(model=MODEL, max_tokens=5, messages=[
                        {"role": "user", "content": "hi"}]) as stream:
                    for text in stream.text_stream:
                        texts.append(text)
                        bad.gate.set()
                raise AssertionError("the stream's error event was not raised")
            except anthropic.APIStatusError as err:
                assert "the engine failed" in str(err)  # the replica's event, as it sent it
            assert texts == ["hello"]
            wait_for(lambda: request_statuses(base).get("500") == 1,
                     what="the request counted with its error event's status")
            assert inflight(base) == 0
