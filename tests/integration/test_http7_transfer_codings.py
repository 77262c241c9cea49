"""A request's ``Transfer-Encoding`` other than one ``chunked`` meets a real `kvgate serve`
(raw sockets): refused before its body, and the connection closed (RFC 9112 6.1 and 6.3;
request smuggling: a proxy in front that reads the framing otherwise sees another request
where kvgate sees a body). ``identity, chunked`` (and the same in two lines, or ``,chunked``)
was served as chunked; ``xchunked`` was a 501 where a request whose final coding is not
chunked MUST be a 400; HTTP/1.0 with chunked was served. ``gzip, chunked`` stays a 501."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.support.gateway import gateway_proc, inflight
from tests.support.procs import sim_proc
from tests.support.raw_http import read_to_close

MODEL = "sim-model"
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    sim, url = sim_proc(model=MODEL)
    with sim:
        gw, base = gateway_proc(upstreams=[url])
        with gw:
            yield base


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def _send(base: str, data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """`data` on a new connection, kept open: every answer until the gateway closes."""
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=30) as s:
        s.sendall(data)
        return read_to_close(s)


def _post(head: bytes, version: bytes = b"1.1", path: bytes = b"/v1/chat/completions") -> bytes:
    return b"POST " + path + b" HTTP/" + version + b"\r\nhost: x\r\n" + head + b"\r\n"


@pytest.mark.parametrize(("codings", "says"), [
    (b"transfer-encoding: identity, chunked\r\n", "'identity, chunked' is not supported"),
    (b"transfer-encoding: identity\r\ntransfer-encoding: chunked\r\n",
     "'identity, chunked' is not supported"),
    (b"transfer-encoding: ,chunked\r\n", "', chunked' is not supported"),
    (b"transfer-encoding: br, identity, chunked\r\n", "is not supported: send chunked alone"),
    (b"transfer-encoding: xchunked\r\n", "'xchunked' does not end in chunked"),
    (b'transfer-encoding: "chunked"\r\n', "does not end in chunked"),
    (b"transfer-encoding: chunked, chunked\r\n", "Transfer-Encoding"),  # the parser's 400
    (b"transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n", "Transfer-Encoding"),
    (b"transfer-encoding: chunked, identity\r\n", "Transfer-Encoding"),
    (b"transfer-encoding: chunked\r\ncontent-length: 5\r\n", "Content-Length"),
    (b"content-length: 5\r\ntransfer-encoding: chunked\r\n", "Content-Length"),
])
def test_a_coding_list_other_than_chunked_is_a_400_and_a_close(
    base: str, codings: bytes, says: str,
) -> None:
    # a keep-alive connection, the body and then a valid request pipelined behind it: the
    # 400 is the only answer (the body is not read as a request), and the connection closes
    got = _send(base, _post(codings) + _chunked(CHAT)
                + _post(b"content-length: %d\r\n" % len(CHAT)) + CHAT)
    assert [status for status, _, _ in got] == [400], got
    _, headers, body = got[0]
    assert headers[b"connection"] == b"close"
    error = json.loads(body)["error"]
    assert error["type"] == "BadRequestError"
    assert says in error["message"], error["message"]
    assert inflight(base) == 0


def test_chunked_in_an_http_1_0_request_is_a_400(base: str) -> None:
    got = _send(base, _post(b"transfer-encoding: chunked\r\n", b"1.0") + _chunked(CHAT))
    assert [status for status, _, _ in got] == [400]
    assert "HTTP/1.0 request cannot carry Transfer-Encoding" in json.loads(got[0][2])[
        "error"]["message"]


def test_on_the_anthropic_route_the_400_is_anthropic_shaped(base: str) -> None:
    got = _send(base, _post(b"transfer-encoding: identity, chunked\r\n",
                            path=b"/v1/messages") + _chunked(CHAT))
    assert [status for status, _, _ in got] == [400]
    body = json.loads(got[0][2])
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("codings", [b"chunked", b"Chunked", b"  CHUNKED  "])
def test_chunked_alone_is_read_and_the_connection_kept(base: str, codings: bytes) -> None:
    got = _send(base, _post(b"transfer-encoding: " + codings + b"\r\n") + _chunked(CHAT)
                + _post(b"content-length: %d\r\nconnection: close\r\n" % len(CHAT)) + CHAT)
    assert [status for status, _, _ in got] == [200, 200], got


def test_a_compression_before_chunked_stays_a_501(base: str) -> None:
    got = _send(base, _post(b"transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n")
                + _chunked(CHAT))
    assert [status for status, _, _ in got] == [501]
    assert got[0][1][b"x-should-retry"] == b"false"
