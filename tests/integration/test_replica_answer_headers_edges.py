"""What of a replica's answer reaches the client at both edges, the picker behind a real
Envoy and the HTTP edge: the headers its ``Connection`` header names (hop by hop), its
``link`` header (URLs of its origin), and a Responses API event's name sent without data.

One loopback replica that answers so (`tests/support/bad_replica.py`), raw HTTP to read the
headers, the official openai client to read a stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from tests.support.bad_replica import CHAT_ANSWER, BadReplica, chunked
from tests.support.epp import both_edges
from tests.support.gateway import inflight, wait_for

MODEL = "m"
EDGES = ["http", "envoy"]
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
# a sidecar's: its internal address
LINK = b"<http://10.0.0.3:8000/v1/models>; rel=preload"


def _event(text: str) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}) + b"\n\n"


@pytest.fixture(scope="module")
def edges() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    with BadReplica(MODEL) as replica, both_edges(replica.url, MODEL, {}) as every:
        yield replica, every


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_headers_connection_names_and_link_do_not_reach_the_client(
    edges: tuple[BadReplica, dict[str, str]], edge: str, stream: bool,
) -> None:
    """``Connection: keep-alive, x-private`` makes ``x-private`` hop by hop (RFC 9110 7.6.1):
    the HTTP edge dropped it, Envoy passed it on (the picker sees the ``connection`` header
    and now has Envoy remove what it names). ``link`` named the replica's internal address
    to the client at both edges, as ``location`` would have (dropped). An end-to-end header
    (``x-sidecar``) still passes at both."""
    replica, bases = edges
    head = (b"HTTP/1.1 200 OK\r\nconnection: keep-alive, x-private\r\nx-private: secret\r\n"
            b"link: " + LINK + b"\r\nx-sidecar: 1\r\n")
    if stream:
        replica.answer = (head + b"content-type: text/event-stream\r\n"
                          b"transfer-encoding: chunked\r\n\r\n"
                          + chunked(_event("hi"), b"data: [DONE]\n\n"))
    else:
        replica.answer = (head + b"content-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % len(CHAT_ANSWER) + CHAT_ANSWER)
    resp = httpx.post(f"{bases[edge]}/v1/chat/completions", timeout=10,
                      json={**BODY, "stream": stream})
    assert resp.status_code == 200, resp.text
    assert "x-private" not in resp.headers
    assert "link" not in resp.headers
    assert resp.headers["x-sidecar"] == "1"
    assert resp.content.endswith(b"data: [DONE]\n\n" if stream else b"}")


@pytest.mark.parametrize("edge", EDGES)
def test_a_responses_event_name_without_data_is_not_an_event_the_sdk_fails_on(
    edges: tuple[BadReplica, dict[str, str]], edge: str,
) -> None:
    """``event: response.in_progress`` then a blank line: SSE dispatches nothing, the SDK an
    event of data "" that it fails to parse (a JSONDecodeError mid-stream, calling the
    replica directly too). kvgate made other fields without data comment lines, but relayed
    this one as sent (its fast path let every ``event: response.`` line by)."""
    replica, bases = edges
    replica.answer = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                      b"transfer-encoding: chunked\r\n\r\n" + chunked(
                          _event("hi"), b"event: response.in_progress\n\n", _event("there"),
                          b"data: [DONE]\n\n"))

    def contents(base: str) -> list[str | None]:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        chunks = client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "x"}], stream=True)
        return [c.choices[0].delta.content for c in chunks]

    with pytest.raises(ValueError, match="Expecting value"):  # (a JSONDecodeError)
        contents(replica.url)
    assert contents(bases[edge]) == ["hi", "there"]
    if edge == "http":
        wait_for(lambda: inflight(bases["http"]) == 0, what="in-flight back to 0")
