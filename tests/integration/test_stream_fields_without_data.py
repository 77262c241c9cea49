"""A stream that opens with lines the client's SSE parser dispatches no event for -- a blank
line, ``event: ping``, ``retry: 3000``, ``id: 7`` with no ``data`` (a proxy in front of a
replica sends such) -- has not answered yet: as with ``: keep-alive`` comments, the bytes go
to the client, but the first-byte timeout still runs and the router learns no first token.

They were taken for the first event: a replica that sent one and hung was waited for until
the idle timeout (the first-byte one, and the try on another replica it allows, lost), and the
router learned that replica's time to first token from it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.bad_replica import BadReplica, behind_a_gateway, chunked, sse_head
from tests.support.gateway import inflight, wait_for

MODEL = "m"
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.fixture(scope="module")
def gw() -> Iterator[tuple[BadReplica, str]]:
    env = {"KVGATE_UPSTREAM__FIRST_BYTE_TIMEOUT_S": "0.5", "KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "3"}
    with behind_a_gateway(MODEL, env) as (replica, base):
        yield replica, base


@pytest.mark.parametrize(
    ("opening", "relayed"),
    [(b"\n\n", b"\n\n"), (b"event: ping\n\n", b":event: ping\n\n"),
     (b"retry: 3000\n\n", b":retry: 3000\n\n"), (b"id: 7\n\n", b"\n"),
     (b"event: ping\r\nid: 7\r\n\r\n", b":event: ping\r\n\r\n")],
    ids=["blank", "event", "retry", "id", "crlf"])
def test_a_stream_opened_without_data_is_cut_at_the_first_byte_timeout(
    gw: tuple[BadReplica, str], opening: bytes, relayed: bytes,
) -> None:
    replica, base = gw
    replica.answer = sse_head() + chunked(opening, last=False)
    replica.rest, replica.gate = chunked(CHUNK, DONE), threading.Event()  # after the cut
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=10, json={
                "model": MODEL, "stream": True,
                "messages": [{"role": "user", "content": "x"}]}) as resp:
            assert resp.status_code == 200
            got = resp.read()
    finally:
        replica.gate.set()
        replica.rest = b""
    # relayed, as keep-alive comments are: as comment lines, ids left out (the official SDK
    # dispatched an event of data "" for them, and failed to parse it: `gateway.sse`)
    assert got.startswith(relayed)
    events = [e for e in got[len(relayed):].split(b"\n\n") if e]
    assert events[-1] == DONE.strip()
    error = orjson.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == 504 and "first byte timeout" in error["message"], error
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_a_stream_whose_data_follows_its_opening_fields_is_relayed_whole(
    gw: tuple[BadReplica, str],
) -> None:
    replica, base = gw
    replica.answer = sse_head() + chunked(b"retry: 3000\n\n", CHUNK, DONE)
    resp = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
        "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 200
    assert resp.content == b":retry: 3000\n\n" + CHUNK + DONE  # (a comment line: `gateway.sse`)
    assert inflight(base) == 0
