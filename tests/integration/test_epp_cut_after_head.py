"""A replica whose connection breaks after its response head, before the client got any of it
(a chunked body closed mid-chunk, a body shorter than its content-length, a stream closed
before its first event): the HTTP edge answers its 502 JSON; behind Envoy the picker still
held the head, and Envoy tears the exchange down and answers the client itself. That answer
was a plain-text 502 ("upstream connect error or disconnect/reset before headers. reset
reason: protocol error", which the SDK shows as the error's message); the bootstrap's local
reply mapper makes it the HTTP edge's 502 JSON for a cut answer.

Envoy's "no healthy upstream" 503 with the picker down (FailOpen) alike: plain text before.

Once a stream's head and first event went out, Envoy resets the client's stream (the SDK
raises a connection error) where the HTTP edge sends an error event: both end the stream as
a failure, never as complete.

Both edges over one loopback replica (`tests/support/bad_replica.py`), the official openai
client, raw HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest

from gateway.whole import CUT_ANSWER
from tests.support.bad_replica import CHAT_ANSWER, BadReplica, chunked, sse_head
from tests.support.epp import both_edges, envoy_proc
from tests.support.gateway import inflight, wait_for
from tests.support.procs import free_port

MODEL = "m"
EDGES = ["http", "envoy"]
EVENT = b"data: " + orjson.dumps({
    "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}) + b"\n\n"
JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
# (the first bytes, the rest sent once the head is surely in, then the connection closed)
CUTS = {
    "whole-mid-chunk": (JSON_HEAD + b"transfer-encoding: chunked\r\n\r\n"
                        + b"%x\r\n" % len(CHAT_ANSWER) + CHAT_ANSWER[:20], CHAT_ANSWER[20:40]),
    "whole-short": (JSON_HEAD + b"content-length: %d\r\n\r\n" % len(CHAT_ANSWER)
                    + CHAT_ANSWER[:20], CHAT_ANSWER[20:40]),
    "stream-mid-first-event": (sse_head(), b"%x\r\n" % len(EVENT) + EVENT[:10]),
}


@pytest.fixture(scope="module")
def edges() -> Iterator[tuple[BadReplica, dict[str, str]]]:
    with BadReplica(MODEL, end="close") as replica, both_edges(replica.url, MODEL, {}) as every:
        yield replica, every


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("cut", CUTS.values(), ids=CUTS.keys())
def test_an_answer_cut_before_the_client_got_its_head_is_a_502_json(
    edges: tuple[BadReplica, dict[str, str]], edge: str, cut: tuple[bytes, bytes],
) -> None:
    replica, bases = edges
    replica.answer, replica.rest = cut
    replica.gate = threading.Event()
    timer = threading.Timer(0.5, replica.gate.set)  # (the head is in by then)
    timer.start()
    stream = replica.answer.startswith(sse_head())
    client = openai.OpenAI(base_url=f"{bases[edge]}/v1", api_key="x", max_retries=0,
                           timeout=30)
    try:
        with pytest.raises(openai.APIStatusError) as caught:
            out = client.chat.completions.create(model=MODEL, stream=stream, messages=[
                {"role": "user", "content": "x"}])
            if isinstance(out, openai.Stream):
                list(out)
    finally:
        timer.join()
        replica.rest = b""
    assert caught.value.status_code == 502
    error = caught.value.response.json()["error"]
    assert error["type"] == "BadGatewayError" and error["code"] == 502
    assert error["message"] in (CUT_ANSWER, "The replica failed before its answer started.")
    if edge == "http":
        wait_for(lambda: inflight(bases["http"]) == 0, what="in-flight back to 0")


@pytest.mark.parametrize("edge", EDGES)
def test_a_stream_cut_mid_chunk_after_its_first_event_ends_as_a_failure(
    edges: tuple[BadReplica, dict[str, str]], edge: str,
) -> None:
    replica, bases = edges
    replica.answer = sse_head() + chunked(EVENT, last=False)
    replica.rest = b"%x\r\n" % len(EVENT) + EVENT[:10]
    replica.gate = threading.Event()
    client = openai.OpenAI(base_url=f"{bases[edge]}/v1", api_key="x", max_retries=0,
                           timeout=30)
    got = []
    try:
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for chunk in client.chat.completions.create(
                    model=MODEL, stream=True, messages=[{"role": "user", "content": "x"}]):
                got.append(chunk.choices[0].delta.content)
                replica.gate.set()  # (the first event is out: now the cut)
    finally:
        replica.gate.set()
        replica.rest = b""
    assert got == ["hi"]


def test_envoys_no_healthy_upstream_without_the_picker_is_openai_shaped() -> None:
    """FailOpen (`failure_mode_allow`) with the shipped ORIGINAL_DST cluster and the picker
    down: a request goes on unpicked, with no destination, and Envoy answers 503 "no healthy
    upstream" itself -- plain text, where the picker words the same answer in OpenAI's shape
    when it sees it; now the bootstrap's local reply mapper does."""
    envoy, base = envoy_proc(f"127.0.0.1:{free_port()}", failure_mode_allow=True)  # no picker
    envoy.start()
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": "x"}])
    finally:
        envoy.stop()
    assert caught.value.status_code == 503
    error = caught.value.response.json()["error"]
    # (on a loaded machine Envoy's call to the absent picker may end in an ext_proc error
    # first, which the picker-down mapper words: OpenAI-shaped as well)
    assert error.pop("message") in (
        "no healthy upstream", "The endpoint picker is unavailable; try again.")
    assert error == {"type": "ServiceUnavailableError", "param": None, "code": 503}
    assert caught.value.response.headers["retry-after"] == "1"
