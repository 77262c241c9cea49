"""A replica (or whatever answers at its address) sending more than any answer holds: a whole
answer, or one stream event, past ``upstream.max_answer_bytes``. kvgate must not hold it all
in memory (a 1.5 GB answer took the gateway to 3 GB) nor spend the event loop copying one
endless event over and over: it stops reading, drops the connection and tells the client with
a 502 in OpenAI's shape (an error event once the stream started), not retried elsewhere; the
gateway's counters return to zero and it serves the next request."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.gateway import gateway_proc, inflight

MODEL = "big-model"
LIMIT = 64 * 1024
BIG = b'{"object":"chat.completion","x":"' + b"a" * (4 * LIMIT) + b'"}'
CHUNK = b"data: " + orjson.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}) + b"\n\n"
SMALL = orjson.dumps({"object": "chat.completion", "choices": []})


def _whole(body: bytes, *, declared: bool = True) -> bytes:
    if declared:
        return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                % len(body) + body)
    pieces = (body[i:i + 8192] for i in range(0, len(body), 8192))
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + chunked(*pieces))


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[BadReplica, BadReplica, str]]:
    config = {
        "pools": {"p": {"served_model": MODEL}},
        "models": {"m": {"default": "p"}},
        "upstream": {"max_answer_bytes": LIMIT, "first_byte_timeout_s": 20},
        "health": {"failure_threshold": 1000},
    }
    with BadReplica(MODEL) as one, BadReplica(MODEL) as two:
        config["pools"]["p"]["replicas"] = [one.url, two.url]  # type: ignore[index]
        proc, base = gateway_proc(config=config)
        with proc:
            yield one, two, base


def _post(base: str, stream: bool) -> httpx.Response:
    body = {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "x"}]}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=20)


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_whole_answer_past_the_limit_is_a_502_not_retried(
    gw: tuple[BadReplica, BadReplica, str], declared: bool,
) -> None:
    one, two, base = gw
    one.answer = two.answer = _whole(BIG, declared=declared)
    before = one.posts + two.posts
    resp = _post(base, stream=False)
    assert resp.status_code == 502
    assert resp.headers["x-should-retry"] == "false"
    error = resp.json()["error"]
    assert error["type"] == "BadGatewayError" and "max_answer_bytes" in error["message"]
    assert one.posts + two.posts == before + 1  # another replica would answer as largely
    assert inflight(base) == 0
    one.answer = two.answer = _whole(SMALL)
    assert _post(base, stream=False).status_code == 200


def test_one_stream_event_past_the_limit_ends_the_stream_with_an_error_event(
    gw: tuple[BadReplica, BadReplica, str],
) -> None:
    one, two, base = gw
    endless = b'data: {"id":"c1","x":"' + b"a" * (4 * LIMIT)  # never ends
    one.answer = two.answer = sse_head() + chunked(CHUNK, last=False)
    one.rest = two.rest = chunked(*(endless[i:i + 4096] for i in range(0, len(endless), 4096)),
                                  last=False)
    one.end = two.end = "close"
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=20) as resp:
            assert resp.status_code == 200
            chunks = resp.iter_bytes()
            received = next(chunks)
            assert received == CHUNK  # the stream started; now the endless event comes
            one.gate.set()
            two.gate.set()
            received += b"".join(chunks)
    finally:
        one.rest = two.rest = b""
        one.end = two.end = "keep"
        one.gate.clear()
        two.gate.clear()
    events = [e for e in received.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and "max_answer_bytes" in error["message"]
    assert len(received) < LIMIT  # none of the endless event was relayed
    assert inflight(base) == 0


def test_an_answer_head_that_does_not_end_is_a_502(
    gw: tuple[BadReplica, BadReplica, str],
) -> None:
    """Headers that go on and on (4 MB of one header, never ended): the exchange fails as an
    answer that is not HTTP, at once, instead of waiting for the first-byte timeout while the
    parser joins the header's pieces (quadratic: 25 MB held the event loop for 27 s)."""
    one, two, base = gw
    one.answer = two.answer = b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * (4 * 1024 * 1024)
    try:
        resp = _post(base, stream=False)
    finally:
        one.answer = two.answer = _whole(SMALL)
    assert resp.status_code == 502
    assert resp.json()["error"]["type"] == "BadGatewayError"
    assert inflight(base) == 0
    assert _post(base, stream=False).status_code == 200
