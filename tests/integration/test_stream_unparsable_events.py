"""A replica (or a proxy in front of it) that sends, mid-stream, an event whose data looks
like a JSON object but does not parse: the official client must raise an APIError saying the
replica sent a bad event, not a JSONDecodeError from deep inside the SDK; the events before it
reach the client, and the request is counted a 502 with nothing left in flight. The replica is
a real loopback server answering exactly those bytes (`tests/support/bad_replica.py`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import orjson
import pytest

from tests.support.bad_replica import BadReplica, behind_a_gateway, chunked, sse_head
from tests.support.gateway import inflight, request_statuses, wait_for

MODEL = "bad-model"
CHUNK = b"data: " + orjson.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}) + b"\n\n"
DONE = b"data: [DONE]\n\n"


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[BadReplica, str]]:
    with behind_a_gateway(MODEL) as (replica, base):
        yield replica, base


@pytest.mark.parametrize("bad", [
    b"data: {not json}\n\n",
    b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"x"}]}\n\n',
    b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"\xff"}}]}\n\n',
], ids=["bare-words", "brackets", "not-utf8"])
def test_an_unparsable_event_mid_stream_is_an_api_error(
    gw: tuple[BadReplica, str], bad: bytes,
) -> None:
    replica, base = gw
    replica.answer = sse_head() + chunked(CHUNK, last=False)
    replica.rest, replica.end = chunked(CHUNK + bad, CHUNK, DONE), "keep"
    before = request_statuses(base).get("502", 0.0)
    try:
        replica.gate = threading.Event()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
        chunks = iter(stream)
        assert next(chunks).choices[0].delta.content == "hi"  # streamed, not held
        replica.gate.set()
        assert next(chunks).choices[0].delta.content == "hi"  # the event before the bad one
        with pytest.raises(openai.APIError, match="not a JSON object"):
            next(chunks)
        stream.close()
        wait_for(lambda: request_statuses(base).get("502", 0.0) == before + 1, what="a 502")
        assert inflight(base) == 0
    finally:
        replica.rest = b""
        replica.gate.set()
