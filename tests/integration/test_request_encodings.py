"""How a real `kvgate serve` takes the ways an HTTP client may send a body: chunked, after an
`Expect: 100-continue`, or compressed (`Content-Encoding`), with the official openai client
where it has the call and raw sockets where it does not."""

from __future__ import annotations

import gzip
import socket
from collections.abc import Callable

import httpx
import openai
import orjson
import pytest

from tests.support.gateway import gateway_proc, inflight, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
BODY = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3})
SimFactory = Callable[..., tuple[Proc, str]]


@pytest.mark.parametrize("coding", ["gzip", "br", "deflate, gzip"])
def test_a_compressed_body_is_a_415_saying_so(sim_factory: SimFactory, coding: str) -> None:
    """Not the "body is not valid JSON: ... surrogates not allowed" its bytes would earn: the
    client is told to send it uncompressed, and which coding is taken (RFC 9110)."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        resp = httpx.post(f"{base}/v1/completions", content=gzip.compress(BODY), headers={
            "Content-Type": "application/json", "Content-Encoding": coding})
        assert resp.status_code == 415, resp.text
        assert resp.headers["accept-encoding"] == "identity"
        err = resp.json()["error"]
        assert err["type"] == "UnsupportedMediaTypeError" and err["code"] == 415
        assert "send the body uncompressed" in err["message"]
        # the openai client reads it as the client error it is (no retry)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                      extra_headers={"Content-Encoding": coding})
        assert exc.value.status_code == 415
        # `identity` is no compression
        ok = httpx.post(f"{base}/v1/completions", content=BODY, headers={
            "Content-Type": "application/json", "Content-Encoding": "identity"})
        assert ok.status_code == 200, ok.text
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_expect_100_continue_and_a_chunked_body_are_answered(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    port = int(base.rsplit(":", 1)[1])
    with gw, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        half = len(BODY) // 2
        for part in (BODY[:half], BODY[half:], b""):
            s.sendall(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        raw = b""
        while b'"usage"' not in raw:
            chunk = s.recv(65536)
            assert chunk, raw  # the gateway closed the connection before the answer's end
            raw += chunk
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n"), raw[:200]


def _read_until_closed(s: socket.socket) -> bytes:
    raw = b""
    while chunk := s.recv(65536):
        raw += chunk
    return raw


def test_an_answer_before_the_body_was_asked_for_closes_the_connection(
    sim_factory: SimFactory,
) -> None:
    """`Expect: 100-continue` and a body over the limit: the 413 comes before any 100, and
    the client keeps its body. The answer says `connection: close` and the connection ends
    with it: it stayed open (closed 5 s later, idle), and a next request sent on it was read
    as the held body and never answered. A body that was asked for keeps the connection."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    port = int(base.rsplit(":", 1)[1])
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n")
    with gw:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head % (9 << 20))
            raw = _read_until_closed(s)
        status, _, rest = raw.partition(b"\r\n")
        assert status == b"HTTP/1.1 413 Request Entity Too Large", raw[:200]
        assert b"\r\nconnection: close\r\n" in rest.lower()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head % len(BODY))
            assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
            s.sendall(BODY + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            raw = _read_until_closed(s)
        assert raw.startswith(b"HTTP/1.1 200 OK\r\n") and raw.count(b"HTTP/1.1 200 OK") == 2


@pytest.mark.parametrize("request_head", [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n",  # no body at all
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"  # sent at once
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY),
], ids=["no-body", "body-sent-at-once"])
def test_an_expect_with_nothing_held_back_keeps_the_connection(
    sim_factory: SimFactory, request_head: bytes,
) -> None:
    """`Expect: 100-continue` on a request whose body is not held back (it has none, or the
    client sent it without waiting): the connection is in step, so the answer keeps it and a
    pipelined request after it is answered. It was closed after the first answer (the
    request was taken for one whose body the client still held) and the next one dropped."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    port = int(base.rsplit(":", 1)[1])
    with gw, socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request_head + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = _read_until_closed(s).replace(b"HTTP/1.1 100 Continue\r\n\r\n", b"")
    assert raw.count(b"HTTP/1.1 200 OK\r\n") == 2, raw[:400]
