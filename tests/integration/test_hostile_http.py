"""Hostile HTTP clients against a real `kvgate serve`, over real sockets: header size and count
limits (431), slow headers and slow bodies (408), with the limits set from the environment;
bytes that are not HTTP/1.1 (400). Every refusal is OpenAI-shaped JSON."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.support.gateway import gateway_proc, request_statuses, wait_for

LIMITS = {"KVGATE_SERVER__HEADER_TIMEOUT_S": "1", "KVGATE_SERVER__BODY_TIMEOUT_S": "1",
          "KVGATE_SERVER__MAX_HEADER_BYTES": "32768"}


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    gw, base = gateway_proc(upstreams=["http://127.0.0.1:9"], ready=False, env=LIMITS)
    with gw:
        yield int(base.rsplit(":", 1)[1])


def exchange(port: int, data: bytes, *, then: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Send `data` (and `then`, if the server still reads), return (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        if then:
            s.sendall(then)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        body = body.split(b"\r\n")[1]  # one chunk
    return int(head.split()[1]), orjson.loads(body)


def test_an_8_mib_header_gets_431(port: int) -> None:
    status, body = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: "
                            + b"a" * (8 << 20) + b"\r\n\r\n")
    assert status == 431
    assert "exceed" in body["error"]["message"]


@pytest.mark.parametrize("where", ["header", "url"])
def test_a_whole_request_over_the_limit_in_one_read_gets_431(port: int, where: str) -> None:
    """40 KiB of request line or headers in one write, with nothing after them (a GET): the
    parser sees the complete request at once, and the limit (32 KiB here) still holds."""
    big = b"a" * (40 << 10)
    request = (b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + big + b"\r\n\r\n"
               if where == "header" else b"GET /healthz?q=" + big + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    status, body = exchange(port, request)
    assert status == 431, body
    assert "32768 bytes" in body["error"]["message"]


def test_100k_headers_get_431(port: int) -> None:
    many = b"".join(b"X-%d: a\r\n" % i for i in range(100_000))
    status, body = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
    assert status == 431
    assert body["error"]["code"] == 431


def test_ordinary_headers_still_pass(port: int) -> None:
    some = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 200) for i in range(60))
    status, body = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                            + some + b"\r\n")
    assert status == 200 and body == {"status": "ok"}


def test_headers_sent_too_slowly_get_408(port: int) -> None:
    # the request line, then nothing: the server must give up on its own
    status, body = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    assert status == 408
    assert body["error"]["type"] == "RequestTimeoutError"


def test_a_body_sent_too_slowly_gets_408(port: int) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n")
    status, body = exchange(port, head + b'{"model": ')  # ... and the rest never comes
    assert status == 408
    assert "body" in body["error"]["message"]


def drip(port: int, head: bytes, rest: bytes) -> tuple[int, dict[str, Any]]:
    """Send `head`, then `rest` one byte every 0.3 s (slowloris) until the server answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        s.settimeout(0.3)
        raw = b""
        for i in range(len(rest)):
            try:
                raw += s.recv(65536)
                break  # the server answered (and closes)
            except TimeoutError:
                s.sendall(rest[i:i + 1])
        s.settimeout(30)
        while chunk := s.recv(65536):
            raw += chunk
    head_part, _, body = raw.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), orjson.loads(body)


def test_dripped_headers_get_408(port: int) -> None:
    status, _ = drip(port, b"GET /healthz HTTP/1.1\r\n", b"X-Slow: " + b"a" * 200 + b"\r\n\r\n")
    assert status == 408


def test_dripped_body_gets_408(port: int) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n")
    before = request_statuses(f"http://127.0.0.1:{port}")
    status, body = drip(port, head, b'{"model": "m", "prompt": "' + b"a" * 170 + b'"}')
    assert status == 408 and "body" in body["error"]["message"]
    # counted as what the client got (it was a 499, a client gone, in the metrics and log)
    wait_for(lambda: request_statuses(f"http://127.0.0.1:{port}").get("408", 0)
             == before.get("408", 0) + 1, what="the 408 counted")
    assert request_statuses(f"http://127.0.0.1:{port}").get("499", 0) == before.get("499", 0)


@pytest.mark.parametrize("request_bytes", [
    b"GET /v1/mod\xffels HTTP/1.1\r\nHost: x\r\n\r\n",  # a path that is not UTF-8
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Content-Length: 3\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",  # request smuggling's ambiguity
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # a TLS hello
], ids=["path-not-utf8", "negative-length", "two-lengths", "length-and-chunked", "tls"])
def test_bytes_that_are_not_http_get_an_openai_shaped_400(port: int, request_bytes: bytes) -> None:
    status, body = exchange(port, request_bytes)
    assert status == 400
    assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400


@pytest.mark.parametrize("request_bytes", [
    b"GET /healthz HTTP/1.0\r\n\r\n",  # a page
    b"GET /nowhere HTTP/1.0\r\n\r\n",  # kvgate's own error
    b"POST /v1/completions HTTP/1.0\r\nContent-Length: 3\r\n\r\n{x}",  # a proxied route's
], ids=["page", "error", "proxied-error"])
def test_whole_answers_carry_their_length_not_chunks(port: int, request_bytes: bytes) -> None:
    """An HTTP/1.0 client (load balancer health checks, ab) cannot read chunked framing."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request_bytes)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    assert b"transfer-encoding: chunked" not in lines, head
    assert f"content-length: {len(body)}".encode() in lines, head
    assert orjson.loads(body)


@pytest.mark.parametrize(("path", "status"), [("/healthz", 200), ("/v1/realtime", 404)])
def test_a_websocket_upgrade_is_answered_as_plain_http(port: int, path: str, status: int) -> None:
    """kvgate serves no WebSocket route (e.g. OpenAI's Realtime API): the request is answered
    as any other, in JSON."""
    got, body = exchange(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n"
                         "Connection: Upgrade, close\r\nUpgrade: websocket\r\n"
                         "Sec-WebSocket-Version: 13\r\n"
                         "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode())
    assert got == status
    assert ("error" in body) == (status != 200)


@pytest.mark.parametrize("sent", [
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n",  # `printf ... | nc -N` without the blank line
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
], ids=["no-blank-line", "cut-in-a-header"])
def test_headers_cut_short_by_a_half_close_get_a_400(port: int, sent: bytes) -> None:
    """The client shut its sending side before its headers ended: they never can. It was
    closed on without a byte (the client could not tell why); it now reads a 400 saying so."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(sent)
        s.shutdown(socket.SHUT_WR)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), raw[:200]
    assert "headers ended" in orjson.loads(body)["error"]["message"]


def test_an_idle_connection_closed_by_its_client_gets_nothing(port: int) -> None:
    """A keep-alive connection its client closes between requests: no request, no answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):  # all of it
            answer += s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        s.shutdown(socket.SHUT_WR)
        rest = b""
        while chunk := s.recv(65536):
            rest += chunk
    assert rest == b""


def test_a_keep_alive_connection_idle_past_clients_expiry_still_serves(port: int) -> None:
    """uvicorn closed an idle keep-alive connection after 5 s: exactly when httpx (and so the
    openai SDK) stops reusing one, so a client reusing it as the gateway closed it got a
    reset. The gateway keeps it longer than clients keep theirs (`keep_alive_timeout_s`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for _ in range(2):
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
                chunk = s.recv(65536)
                assert chunk, "the gateway closed the idle connection"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 "), answer
            s.settimeout(6.5)  # idle past 5 s (an event would be a close: none may come)
            with pytest.raises(TimeoutError):
                s.recv(1)
            s.settimeout(30)
