"""A replica that answers one byte at a time -- SSE events split at every byte, multi-byte
UTF-8 characters split across TCP segments, chunked framing split inside its size lines -- is
relayed whole and byte for byte at both edges, the picker behind a real Envoy and the HTTP
edge, and the official openai client reads the text it sent.

One loopback replica that drips its answer (`tests/support/bad_replica.py`).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.epp import both_edges

MODEL = "m"
EDGES = ["http", "envoy"]
TEXTS = ["h\u00e9llo ", "\u4e16\u754c ", "\U0001f389!"]  # 2-, 3- and 4-byte characters
STREAM = b"".join(b"data: " + orjson.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": t}, "finish_reason": None}]}) + b"\n\n"
    for t in TEXTS) + b"data: [DONE]\n\n"
WHOLE = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "".join(TEXTS)}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}})


@pytest.fixture(scope="module")
def edges() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    with BadReplica(MODEL) as replica, both_edges(replica.url, MODEL, {}) as every:
        replica.drip_s = 0.002
        yield replica, every


def _bytes(data: bytes) -> list[bytes]:
    return [data[i:i + 1] for i in range(len(data))]


FRAMINGS = {
    # each byte its own chunk: events and characters split at every byte
    "chunk-per-byte": [chunked(b, last=False) for b in _bytes(STREAM)] + [b"0\r\n\r\n"],
    # one chunked body sent a byte at a time: its size lines split too
    "byte-per-segment": _bytes(chunked(STREAM)),
}


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("drip", FRAMINGS.values(), ids=FRAMINGS.keys())
def test_a_stream_sent_byte_by_byte_is_relayed_whole(
    edges: tuple[BadReplica, dict[str, str]], edge: str, drip: list[bytes],
) -> None:
    replica, bases = edges
    replica.answer, replica.drip = sse_head(), drip
    resp = httpx.post(f"{bases[edge]}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 200
    assert resp.content == STREAM
    client = openai.OpenAI(base_url=f"{bases[edge]}/v1", api_key="x", max_retries=0,
                           timeout=60)
    chunks = client.chat.completions.create(model=MODEL, stream=True, messages=[
        {"role": "user", "content": "x"}])
    assert [c.choices[0].delta.content for c in chunks] == TEXTS


@pytest.mark.parametrize("edge", EDGES)
def test_a_whole_answer_sent_byte_by_byte_is_relayed_whole(
    edges: tuple[BadReplica, dict[str, str]], edge: str,
) -> None:
    replica, bases = edges
    replica.answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n" % len(WHOLE))
    replica.drip = _bytes(WHOLE)
    client = openai.OpenAI(base_url=f"{bases[edge]}/v1", api_key="x", max_retries=0,
                           timeout=60)
    answer = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "x"}])
    assert answer.choices[0].message.content == "".join(TEXTS)
