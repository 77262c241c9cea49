"""An answer given while its request's body is still arriving (a 413 for a `Content-Length`
past `server.max_body_bytes`) on a connection that closes after it (the client said
`Connection: close`, or HTTP/1.0) closes lingering: the client, still writing its body, is
not reset, reads the 413 and the close, and the answers pipelined before it come first.
uvicorn closed such a connection at once, and the client's writes failed with ECONNRESET.
A keep-alive connection with more than 1 MiB of the body due closes alike (the 413 says
`Connection: close`); a smaller rest is read and the connection kept
(test_http7_early_refusals).
Real `kvgate serve --no-auth` in front of a simulated replica; raw sockets and the official
openai client."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import openai
import pytest

from tests.support.gateway import gateway_proc, inflight
from tests.support.procs import sim_proc
from tests.support.raw_http import read_to_close

MODEL = "sim-model"
LIMIT = 1024 * 1024
SMALL = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3}).encode()


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    sim, sim_url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim:
        gw, url = gateway_proc(upstreams=[sim_url],
                               env={"KVGATE_SERVER__MAX_BODY_BYTES": str(LIMIT)})
        with gw:
            yield url


def _head(length: int, extra: bytes = b"") -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\n" + extra + b"Content-Length: %d\r\n\r\n" % length)


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def test_answers_pipelined_before_an_oversized_body_come_first(base: str) -> None:
    with socket.create_connection(("127.0.0.1", _port(base))) as s:
        s.sendall(_head(len(SMALL)) + SMALL + _head(20 * LIMIT, b"Connection: close\r\n")
                  + b" " * 1000)  # ... and nothing more
        got = read_to_close(s)
    assert [status for status, _, _ in got] == [200, 413]
    assert json.loads(got[0][2])["object"] == "chat.completion"


@pytest.mark.parametrize("version", [b"1.1", b"1.0"])
def test_a_client_closing_after_the_answer_writes_its_whole_body_and_reads_the_413(
    base: str, version: bytes,
) -> None:
    body = b" " * (4 * LIMIT)
    failed: list[BaseException] = []
    head = _head(len(body), b"Connection: close\r\n").replace(b"HTTP/1.1", b"HTTP/" + version)
    with socket.create_connection(("127.0.0.1", _port(base))) as s:
        s.sendall(head)

        def write() -> None:
            try:
                s.sendall(body)
            except OSError as exc:  # a reset: the gateway closed while it wrote
                failed.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        got = read_to_close(s)
        writer.join(30)
    assert not failed, failed
    assert [status for status, _, _ in got] == [413]


def test_a_keep_alive_connection_is_closed_rather_than_drained(
    base: str,
) -> None:
    """A body of more than 1 MiB still due when the 413 goes out is not read to keep the
    connection (`gateway.pipelining.DRAIN_MAX_BYTES`): the 413 says ``Connection: close``;
    the client, writing its body on, is not reset and reads it."""
    body = b" " * (2 * LIMIT)
    with socket.create_connection(("127.0.0.1", _port(base))) as s:
        s.sendall(_head(len(body)))
        s.sendall(body)
        s.sendall(_head(len(SMALL), b"Connection: close\r\n") + SMALL)
        got = read_to_close(s)
    assert [status for status, _, _ in got] == [413]
    assert got[0][1][b"connection"] == b"close"


def test_the_sdk_gets_the_413_and_its_next_request_is_served(base: str) -> None:
    with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60) as sdk:
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a" * (3 * LIMIT)}])
        assert caught.value.status_code == 413
        reply = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert reply.choices[0].message.content
    assert inflight(base) == 0
