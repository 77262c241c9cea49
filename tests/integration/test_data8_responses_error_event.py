"""A Responses API stream's failure events are errors, as chat's error events are.

The Responses API ends a failed stream with its ``error`` event (``{"type": "error", "code":
..., "message": ...}``, flat) or ``response.failed`` (its ``response.error`` says why). vLLM's
Responses stream opens with ``response.created`` and ``response.in_progress``, which kvgate holds
until the first output. kvgate read only chat's error events (``data: {"error": ...}``): such a
failure as the first event after the opening ones went to the client as a started stream,
where the same failure on ``/v1/chat/completions`` is tried on another replica; and a stream
failing so mid-answer counted as served (status 200), its replica not charged. Now both are
read as the error they are: first, another replica answers; mid-stream, the client gets the
event as sent and the request counts the event's status.

A real gateway (round robin over two loopback replicas, one failing so), the official openai
client.
"""

from __future__ import annotations

import openai
import orjson
import pytest

from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.gateway import gateway_proc, inflight, request_statuses, wait_for

MODEL = "m"
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 1, "model": MODEL,
            "status": "in_progress", "output": [], "error": None}


def _event(doc: dict[str, object]) -> bytes:
    return b"event: " + str(doc["type"]).encode() + b"\ndata: " + orjson.dumps(doc) + b"\n\n"


OPENING = (_event({"type": "response.created", "sequence_number": 0, "response": RESPONSE}),
           _event({"type": "response.in_progress", "sequence_number": 1, "response": RESPONSE}))
DELTA = _event({"type": "response.output_text.delta", "sequence_number": 2, "item_id": "msg_1",
                "output_index": 0, "content_index": 0, "delta": "hello", "logprobs": []})
COMPLETED = _event({"type": "response.completed", "sequence_number": 3,
                    "response": {**RESPONSE, "status": "completed"}})
ERROR = _event({"type": "error", "code": "server_error", "message": "the engine failed",
                "param": None, "sequence_number": 2})
FAILED = _event({"type": "response.failed", "sequence_number": 2, "response": {
    **RESPONSE, "status": "failed",
    "error": {"code": "server_error", "message": "the engine failed"}}})
WHOLE = sse_head() + chunked(*OPENING, DELTA, COMPLETED)
ENV = {"KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"}


@pytest.mark.parametrize("failure", [ERROR, FAILED], ids=["error", "response.failed"])
def test_a_failure_event_first_is_tried_on_another_replica(failure: bytes) -> None:
    with BadReplica(MODEL, answer=sse_head() + chunked(*OPENING, failure)) as bad, \
            BadReplica(MODEL, answer=WHOLE) as good:
        gw, base = gateway_proc(upstreams=[bad.url, good.url],
                                args=["--policy", "round_robin"], env=ENV)
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=30)
            for _ in range(4):  # round robin: the failing replica is asked first at least once
                kinds = [e.type for e in client.responses.create(
                    model=MODEL, input="hi", stream=True)]
                assert kinds == ["response.created", "response.in_progress",
                                 "response.output_text.delta", "response.completed"]
            assert bad.posts >= 1 and good.posts == 4
            wait_for(lambda: inflight(base) == 0, what="no request left in flight")
            assert request_statuses(base) == {"200": 4.0}


@pytest.mark.parametrize("ended", [True, False], ids=["body_ended", "body_held_open"])
@pytest.mark.parametrize("failure", [ERROR, FAILED], ids=["error", "response.failed"])
def test_a_failure_event_mid_stream_is_relayed_and_counted_as_the_error(
    failure: bytes, ended: bool,
) -> None:
    """The failure event ends the stream (no [DONE] follows it on this API) even when the
    body is held open after it: the client's stream ends then, not at the idle timeout (here
    10 minutes, past the client's 30 s) with a 504 event after the replica's error."""
    with BadReplica(MODEL) as bad:
        bad.answer = sse_head() + chunked(*OPENING, DELTA, last=False)
        bad.rest = chunked(failure, last=ended)  # once the client has "hello"
        gw, base = gateway_proc(upstreams=[bad.url],
                                env={**ENV, "KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "600"})
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=30)
            kinds = []
            for event in client.responses.create(model=MODEL, input="hi", stream=True):
                kinds.append(event.type)
                if event.type == "response.output_text.delta":
                    assert event.delta == "hello"
                    bad.gate.set()
            assert kinds[-2:] == ["response.output_text.delta",
                                  "error" if failure is ERROR else "response.failed"]
            wait_for(lambda: request_statuses(base).get("500") == 1,
                     what="the request counted with its failure event's status")
            assert "200" not in request_statuses(base)
            assert inflight(base) == 0


def test_a_client_error_event_is_counted_with_its_status() -> None:
    """A failure event with a client error's code (`rate_limit_exceeded`: 429) is the
    request's answer, relayed as sent: counted with that status, not as a 200 served."""
    limited = ERROR.replace(b"server_error", b"rate_limit_exceeded")
    with BadReplica(MODEL, answer=sse_head() + chunked(*OPENING, DELTA, limited)) as bad:
        gw, base = gateway_proc(upstreams=[bad.url], env=ENV)
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=30)
            kinds = [e.type for e in client.responses.create(model=MODEL, input="hi",
                                                              stream=True)]
            assert kinds[-2:] == ["response.output_text.delta", "error"]
            wait_for(lambda: request_statuses(base) == {"429": 1.0},
                     what="the request counted with its event's status")
            assert inflight(base) == 0
