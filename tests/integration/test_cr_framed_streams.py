"""SSE lets a line end with CR, LF or CRLF, so an event may end with a bare ``\\r\\r`` (a
misbehaving upstream, or a proxy in front of one). Through a real gateway, from a real
loopback replica sending exactly those bytes, to the official openai client (which reads
such events): every event arrives as it comes, the usage-only chunk kvgate asked for is
stripped, ``[DONE]`` ends the stream, and a stream cut short is still told apart."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from tests.support.bad_replica import BadReplica, behind_a_gateway, chunked, sse_head

MODEL = "cr-model"


def _chunk(content: str | None, *, usage: bool = False) -> bytes:
    choices = [] if usage else [{"index": 0, "delta": {"content": content},
                                 "finish_reason": None}]
    body: dict[str, object] = {"id": "c1", "object": "chat.completion.chunk", "created": 1,
                               "model": MODEL, "choices": choices}
    if usage:
        body["usage"] = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    return b"data: " + orjson.dumps(body)


HI, THERE, USAGE, DONE = _chunk("hi"), _chunk(" there"), _chunk(None, usage=True), b"data: [DONE]"


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[BadReplica, str]]:
    with behind_a_gateway(MODEL) as (replica, base):
        yield replica, base


def _texts(base: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    out = []
    for c in stream:
        assert c.choices, "the usage-only chunk kvgate asked for reached the client"
        out.append(c.choices[0].delta.content or "")
    return out


@pytest.mark.parametrize("parts", [
    (HI + b"\r\r" + THERE + b"\r\r" + USAGE + b"\r\r" + DONE + b"\r\r",),  # one read
    (HI + b"\r\r", THERE + b"\r\r", USAGE + b"\r\r" + DONE + b"\r\r"),  # a read per event
    (HI + b"\r", b"\r" + THERE + b"\r\r" + USAGE + b"\r", b"\r" + DONE + b"\r\r"),  # split ends
    # every framing in one stream (and a CR line end inside an event)
    (HI + b"\n\n" + THERE + b"\r\r" + USAGE + b"\r\n\r\n" + b": ok\r\r" + DONE + b"\r\n\n",),
    (HI + b"\r\n\r" + THERE + b"\n\r" + USAGE + b"\r\r\n" + DONE + b"\n\r\n",),
], ids=["one-read", "per-event", "split-ends", "mixed", "mixed-odd"])
def test_cr_framed_events_pass_whole(gw: tuple[BadReplica, str], parts: tuple[bytes, ...]) -> None:
    replica, base = gw
    replica.answer, replica.end = sse_head() + chunked(*parts), "keep"
    assert _texts(base) == ["hi", " there"]


def test_each_cr_framed_event_is_relayed_as_it_comes(gw: tuple[BadReplica, str]) -> None:
    replica, base = gw
    replica.answer = sse_head() + chunked(HI + b"\r\r", last=False)
    replica.rest = chunked(THERE + b"\r\r" + USAGE + b"\r\r" + DONE + b"\r\r")
    replica.gate, replica.end = threading.Event(), "keep"
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=10) as r:
            reads = r.iter_raw()
            assert next(reads) == HI + b"\r\r"  # before the replica sent more
            replica.gate.set()
            rest = b"".join(reads)
        assert rest == THERE + b"\r\r" + DONE + b"\r\r"
    finally:
        replica.rest = b""
        replica.gate.set()


def test_a_cr_framed_stream_cut_short_is_an_error(gw: tuple[BadReplica, str]) -> None:
    replica, base = gw
    replica.answer, replica.end = sse_head() + chunked(HI + b"\r\r" + THERE + b"\r\r"), "keep"
    with pytest.raises(openai.APIError, match="before it was complete"):
        _texts(base)
