"""An answer with neither a length nor chunks (``connection: close`` framing: its body ends
with the connection) ends at a clean close (a FIN); a TCP reset cuts it short, as it cuts any
other answer. The reset was taken for the end too: a whole answer cut inside its JSON at a
nested object's ``}`` (so it still opens and closes as an object) reached the client as a 200
it could not parse."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, End, behind_a_gateway, sse_head
from tests.support.gateway import inflight, request_statuses

MODEL = "m"
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
CUT = CHAT_ANSWER[:CHAT_ANSWER.index(b"}]") + 1]  # `}` after the message: its `]}` not sent
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[BadReplica, str]]:
    with behind_a_gateway(MODEL) as (replica, base):
        yield replica, base
        replica.end = "keep"


def _chat(base: str, stream: bool) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "x"}]})


def test_a_whole_answer_cut_by_a_reset_is_a_502(gw: tuple[BadReplica, str]) -> None:
    replica, base = gw
    replica.answer, replica.end = HEAD + CUT, "reset"
    before = request_statuses(base).get("502", 0.0)
    resp = _chat(base, stream=False)
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["type"] == "BadGatewayError" and "failed while answering" in error["message"]
    assert request_statuses(base).get("502", 0.0) == before + 1
    assert inflight(base) == 0


def test_a_whole_answer_ended_by_a_close_is_the_answer(gw: tuple[BadReplica, str]) -> None:
    replica, base = gw
    replica.answer, replica.end = HEAD + CHAT_ANSWER, "close"
    resp = _chat(base, stream=False)
    assert resp.status_code == 200
    assert resp.content == CHAT_ANSWER


def test_a_stream_cut_by_a_reset_ends_with_an_error_event(gw: tuple[BadReplica, str]) -> None:
    replica, base = gw
    replica.answer, replica.end = sse_head(chunked_body=False) + CHUNK, "reset"
    resp = _chat(base, stream=True)
    assert resp.status_code == 200
    events = [e for e in resp.content.split(b"\n\n") if e]
    assert events[0] == CHUNK.strip() and events[-1] == DONE.strip()
    error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and "failed mid-stream" in error["message"], error
    assert inflight(base) == 0


@pytest.mark.parametrize("end", ["close", "reset"])
def test_a_stream_whose_done_came_is_whole_however_its_connection_ends(
    gw: tuple[BadReplica, str], end: End,
) -> None:
    replica, base = gw
    replica.answer, replica.end = sse_head(chunked_body=False) + CHUNK + DONE, end
    resp = _chat(base, stream=True)
    assert resp.status_code == 200
    assert resp.content == CHUNK + DONE
    assert inflight(base) == 0
