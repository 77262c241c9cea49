"""The endpoint picker behind a real Envoy answers two broken answers as the HTTP edge does: a
200 labelled JSON whose body is no JSON object (a proxy's HTML page, an empty or cut body,
null; a stored response's 2xx other than 200 or redirect too) and a stream held open after
its last event.

Both edges over one loopback replica that answers so (`tests/support/bad_replica.py`), the
official openai client, raw HTTP to see a stream's every byte.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from tests.integration.test_stored_stream import COMPLETED, CREATED, DELTA, RID, WHOLE
from tests.support.bad_replica import BadReplica, chunked, sse_head, whole
from tests.support.epp import both_edges
from tests.support.gateway import inflight, metric_values, wait_for

MODEL = "m"
EDGES = ["http", "envoy"]
EVENT = b"data: " + orjson.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hello"},
                 "finish_reason": "stop"}]}) + b"\n\n"
DONE = b"data: [DONE]\n\n"


def _json_200(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + b"content-length: %d\r\n\r\n" % len(body) + body)


MISLABELLED = {
    "html": b"<html><body>502 Bad Gateway</body></html>",
    "empty": b"",
    "cut": b'{"id": "chatcmpl-1", "object": "chat.comp',
    "null": b"null",
}


@pytest.fixture(scope="module")
def edges() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    with BadReplica(MODEL) as replica, both_edges(
            replica.url, MODEL, {"idle_timeout_s": 10}) as every:
        replica.answer = whole(WHOLE)  # RID stored through each edge
        for edge in EDGES:
            assert httpx.post(f"{every[edge]}/v1/responses", timeout=10,
                              json={"model": MODEL, "input": "x"}).status_code == 200
        yield replica, every


@pytest.fixture
def replica(edges: tuple[BadReplica, dict[str, str]]) -> Iterator[BadReplica]:
    replica = edges[0]
    replica.gate = threading.Event()
    yield replica
    replica.gate.set()
    replica.rest, replica.get_answer = b"", None


def _failures(metrics: str) -> float:
    return sum(metric_values(metrics, "kvgate_replica_failures_total").values())


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("body", MISLABELLED.values(), ids=MISLABELLED.keys())
def test_a_200_labelled_json_that_is_no_object_is_a_502_at_both_edges(
    edges: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, body: bytes,
) -> None:
    """The picker relayed it as a 200 (the SDK failed to decode it) and judged the replica by
    a success; now it is the HTTP edge's 502 and a failure of the replica (a stored response's
    answer: the 502, not judged, as there). Envoy holds a whole answer's head until the
    picker has its body, so the picker can still answer the client so."""
    every = edges[1]
    replica.answer = replica.get_answer = _json_200(body)
    before = _failures(every[f"{edge}-metrics"])
    client = openai.OpenAI(base_url=f"{every[edge]}/v1", api_key="x", max_retries=0,
                           timeout=15)
    for stored in [False, True]:  # a stored response's: a 502, not judged
        with pytest.raises(openai.InternalServerError) as err:
            if stored:
                client.responses.retrieve(RID)
            else:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert err.value.status_code == 502
        assert err.value.body == {
            "message": "The replica's answer is not JSON (application/json).",
            "type": "BadGatewayError", "param": None, "code": 502}
    assert _failures(every[f"{edge}-metrics"]) == before + 1


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("route", ["chat", "responses", "stored"])
def test_a_stream_held_open_after_its_last_event_ends_at_both_edges(
    edges: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, route: str,
) -> None:
    """The picker kept the client, the in-flight count and the lease until the idle timeout,
    then sent a 504 error event after the stream's end and charged the replica a failure."""
    every = edges[1]
    events = EVENT + DONE if route == "chat" else CREATED + DELTA + COMPLETED
    replica.answer = replica.get_answer = sse_head() + chunked(events, last=False)
    replica.rest = b"0\r\n\r\n"  # the end: never, in this test
    method, path, body = {
        "chat": ("POST", "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
        "responses": ("POST", "/v1/responses", {"model": MODEL, "input": "x", "stream": True}),
        "stored": ("GET", f"/v1/responses/{RID}?stream=true", None)}[route]
    before = _failures(every[f"{edge}-metrics"])
    started = time.monotonic()
    with httpx.stream(method, f"{every[edge]}{path}", json=body, timeout=30) as resp:
        got = b"".join(resp.iter_raw())
    assert time.monotonic() - started < 5
    assert got == events
    wait_for(lambda: inflight(every[f"{edge}-metrics"]) == 0, 3, "nothing in flight")
    assert _failures(every[f"{edge}-metrics"]) == before


STORED_ODD = {
    "page": (b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 6\r\n\r\n<html>",
             "The replica's answer is not JSON (text/html)."),
    "redirect": (b"HTTP/1.1 302 Found\r\nlocation: http://127.0.0.1:9/x\r\ncontent-length: 0"
                 b"\r\n\r\n", "The replica answered 302, not an answer."),
    "no-content": (b"HTTP/1.1 204 No Content\r\n\r\n", "The replica answered 204, not an answer."),
}


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize(("answer", "message"), STORED_ODD.values(), ids=STORED_ODD.keys())
def test_a_stored_responses_answer_that_is_no_answer_is_a_502_at_both_edges(
    edges: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, answer: bytes,
    message: str,
) -> None:
    """A stored response's answer that is a 2xx other than 200, a redirect or a 200 page: the
    picker relayed it (the SDK got a str, a 204 or a 302 naming an internal address)."""
    replica.get_answer = answer
    client = openai.OpenAI(base_url=f"{edges[1][edge]}/v1", api_key="x", max_retries=0,
                           timeout=15)
    with pytest.raises(openai.InternalServerError) as err:
        client.responses.retrieve(RID)
    assert err.value.body == {"message": message, "type": "BadGatewayError", "param": None,
                              "code": 502}


# a replica's request validation errors: vLLM's own (400, OpenAI's shape) and FastAPI's 422
# list of pydantic errors (a route or version without vLLM's handler); `input` echoes the body
VALIDATION = {
    "vllm-400": (400, {"error": {"message": "1 validation error: 'max_tokens' must be an "
                                 "integer", "type": "Bad Request", "param": "max_tokens",
                                 "code": 400}}),
    "fastapi-422": (422, {"detail": [
        {"type": "int_parsing", "loc": ["body", "max_tokens"], "input": "secret prompt",
         "msg": "Input should be a valid integer, unable to parse string as an integer"},
        {"type": "missing", "loc": ["body", "messages"], "msg": "Field required"}]}),
}


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("status", "answer"), VALIDATION.values(), ids=VALIDATION.keys())
def test_a_replicas_validation_error_reaches_the_client_at_both_edges(
    edges: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, stream: bool,
    status: int, answer: dict[str, object],
) -> None:
    """The client learns which field was wrong, in OpenAI's shape, with the replica's status,
    and the replica is not charged for the client's mistake. FastAPI's 422 list reached the
    client as "The upstream replica answered 422." with no param."""
    every = edges[1]
    replica.answer = whole(orjson.dumps(answer), status=status)
    before = _failures(every[f"{edge}-metrics"])
    client = openai.OpenAI(base_url=f"{every[edge]}/v1", api_key="x", max_retries=0,
                           timeout=15)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=stream)
    assert err.value.status_code == status
    body = err.value.body
    assert isinstance(body, dict)
    assert body["param"] == "max_tokens" and body["code"] == status
    assert "max_tokens" in body["message"] and "secret" not in body["message"]
    if status == 422:
        assert body == {
            "message": "2 validation errors: max_tokens: Input should be a valid integer, "
                       "unable to parse string as an integer; messages: Field required",
            "type": "UnprocessableEntityError", "param": "max_tokens", "code": 422}
    assert _failures(every[f"{edge}-metrics"]) == before
