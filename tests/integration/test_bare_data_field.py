"""A stream event that is a bare ``data`` line (a data field without its colon) through both
edges: by the SSE spec it is the event ``data:`` is, with data "" (the SDK dispatches it and
fails to parse it as JSON). Before, the HTTP edge and the picker made it a comment line (the
stream went on), while ``data:`` ended the stream with a 502 error event; both now get the
same answer: before the stream's first event the 502 JSON, after it the 502 error event and
``[DONE]``.

Both edges (`kvgate serve`; `kvgate epp` behind a real Envoy) over one loopback replica that
answers so (`tests/support/bad_replica.py`), raw HTTP to see a stream's every byte.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.bad_replica import BadReplica, chunked, sse_head
from tests.support.epp import both_edges
from tests.support.gateway import inflight, wait_for

MODEL = "m"
EDGES = ["http", "envoy"]
EVENT = b"data: " + orjson.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hello"},
                 "finish_reason": None}]}) + b"\n\n"
DONE = b"data: [DONE]\n\n"
EMPTY = {"colon": b"data:\n\n", "bare": b"data\n\n"}
NOT_JSON = {"message": "The upstream replica sent a stream event that is not a JSON object.",
            "type": "BadGatewayError", "param": None, "code": 502}
BODY = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def edges() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    with BadReplica(MODEL) as replica, both_edges(
            replica.url, MODEL, {"idle_timeout_s": 10}) as every:
        yield replica, every


@pytest.fixture
def replica(edges: tuple[BadReplica, dict[str, str]]) -> Iterator[BadReplica]:
    replica = edges[0]
    replica.gate = threading.Event()
    yield replica
    replica.gate.set()
    replica.rest = b""


def _mid_stream(replica: BadReplica, base: str, empty: bytes) -> list[bytes]:
    """The events a client got when `empty` followed the stream's first event."""
    replica.answer = sse_head() + chunked(EVENT, last=False)
    replica.rest = chunked(empty, EVENT, DONE)
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=BODY, timeout=30) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_bytes()
        received = next(chunks)  # the first event went out before the rest was sent
        replica.gate.set()
        received += b"".join(chunks)
    return [e for e in received.split(b"\n\n") if e]


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("empty", EMPTY.values(), ids=EMPTY.keys())
def test_an_empty_data_field_mid_stream_ends_it_with_the_502_event(
    edges: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, empty: bytes,
) -> None:
    every = edges[1]
    got = _mid_stream(replica, every[edge], empty)
    assert got[0] == EVENT.strip() and got[-1] == DONE.strip() and len(got) == 3, got
    assert orjson.loads(got[1].removeprefix(b"data: "))["error"] == NOT_JSON
    wait_for(lambda: inflight(every[f"{edge}-metrics"]) == 0, what="nothing in flight")


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("empty", EMPTY.values(), ids=EMPTY.keys())
def test_an_empty_data_field_first_is_the_502(
    edges: tuple[BadReplica, dict[str, str]], replica: BadReplica, edge: str, empty: bytes,
) -> None:
    every = edges[1]
    replica.answer = sse_head() + chunked(empty, EVENT, DONE)
    resp = httpx.post(f"{every[edge]}/v1/chat/completions", json=BODY, timeout=30)
    assert resp.status_code == 502, resp.text
    assert resp.json() == {"error": NOT_JSON}
    wait_for(lambda: inflight(every[f"{edge}-metrics"]) == 0, what="nothing in flight")
