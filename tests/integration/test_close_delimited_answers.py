"""An answer with neither a length nor chunks (``connection: close`` framing: its body ends
with the connection) ends at a clean close (a FIN); a TCP reset cuts it short, as it cuts any
other answer. The reset was taken for the end too: a whole answer cut inside its JSON at a
nested object's ``}`` (so it still opens and closes as an object) reached the client as a 200
it could not parse. A clean close can cut it as well (a proxy's idle timeout, a replica's
worker killed after a flush): such a body is whole only when it parses -- a proxied answer
cut so is a 502 another replica may replace, a stored response fetched whole a 502 too."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.bad_replica import (
    CHAT_ANSWER,
    BadReplica,
    End,
    behind_a_gateway,
    sse_head,
    whole,
)
from tests.support.gateway import gateway_proc, inflight, request_statuses

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


def _chat(base: str, stream: bool, content: str = "x") -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "stream": stream, "messages": [{"role": "user", "content": content}]})


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


def test_a_whole_answer_cut_by_a_clean_close_is_a_502(gw: tuple[BadReplica, str]) -> None:
    replica, base = gw
    replica.answer, replica.end = HEAD + CUT, "close"
    before = request_statuses(base).get("502", 0.0)
    resp = _chat(base, stream=False)
    assert resp.status_code == 502, resp.text
    error = resp.json()["error"]
    assert error["type"] == "BadGatewayError" and "failed while answering" in error["message"]
    assert request_statuses(base).get("502", 0.0) == before + 1
    assert inflight(base) == 0


def test_a_stored_response_cut_by_a_clean_close_is_a_502(gw: tuple[BadReplica, str]) -> None:
    replica, base = gw
    stored = orjson.dumps({"id": "resp_cut1", "object": "response", "model": MODEL,
                           "status": "completed", "output": [{"type": "message"}]})
    replica.answer, replica.end = whole(stored), "keep"
    assert httpx.post(f"{base}/v1/responses", timeout=10,
                      json={"model": MODEL, "input": "x"}).status_code == 200
    replica.get_answer, replica.end = HEAD + stored[:stored.index(b"}]") + 1], "close"
    try:
        resp = httpx.get(f"{base}/v1/responses/resp_cut1", timeout=10)
    finally:
        replica.get_answer = None
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["type"] == "BadGatewayError"


def test_a_whole_answer_cut_by_a_close_is_answered_by_another_replica() -> None:
    with BadReplica(MODEL, HEAD + CUT, "close") as cutting, \
            BadReplica(MODEL, whole(CHAT_ANSWER)) as sound:
        proc, base = gateway_proc(upstreams=[cutting.url, sound.url],
                                  env={"KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"})
        with proc:
            for i in range(40):  # until the cutting replica was tried (the pick is the
                # router's: prompts of their own, so no prefix holds them to one replica)
                resp = _chat(base, stream=False, content=f"{i} " * 300)
                assert resp.status_code == 200, resp.text
                assert resp.content == CHAT_ANSWER
                if cutting.posts:
                    break
            assert cutting.posts and sound.posts
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
