"""A request answered before its body ends, at a real `kvgate serve` (raw sockets):

- on a keep-alive connection, a body with more than 1 MiB still due (a 413 for a
  large ``Content-Length``, a chunked body past the limit) is not read to keep the
  connection: the answer says ``Connection: close`` and the connection closes (the whole
  announced body was drained, up to the body timeout); a smaller rest is still drained and
  the connection serves the next request;
- the lingering close after such an answer (or a guard's refusal: 431) is bounded: a client
  that trickles its body a byte at a time is closed on in about 2 s (it held the
  connection 30 s)."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from tests.support.gateway import gateway_proc, inflight
from tests.support.procs import sim_proc
from tests.support.raw_http import Answers, read_to_close

MODEL = "sim-model"
LIMIT = 2 * 1024 * 1024  # server.max_body_bytes here (above DRAIN_MAX_BYTES)
SMALL = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2}).encode()
DRAIN_MAX_BYTES = 1024 * 1024  # gateway.pipelining's (not imported: the test ran before it)
TRICKLE_S = 0.1  # between two bytes of a trickled body
# bytes a trickling client sends before the gateway must have closed: 10 s, 5 x the linger
# budget (gateway.pipelining.LINGER_MAX_S)
TRICKLE_MAX = 100


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    sim, url = sim_proc(model=MODEL)
    with sim:
        gw, base = gateway_proc(upstreams=[url], env={
            "KVGATE_SERVER__MAX_BODY_BYTES": str(LIMIT),
            "KVGATE_SERVER__MAX_HEADER_BYTES": "4096"})
        with gw:
            yield base


def _connect(base: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=30)


def _head(extra: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
            b"\r\n" + extra + b"\r\n")


def test_a_large_announced_body_is_answered_413_with_a_close_unread(base: str) -> None:
    with _connect(base) as s:  # the body never comes: the 413 and the close must anyway
        s.sendall(_head(b"content-length: %d\r\n" % (1 << 30)))
        got = read_to_close(s)
    assert [status for status, _, _ in got] == [413]
    assert got[0][1][b"connection"] == b"close"
    assert inflight(base) == 0


def test_a_chunked_body_past_the_limit_is_answered_with_a_close(base: str) -> None:
    part = b"a" * (LIMIT // 2)
    with _connect(base) as s:  # more chunks would follow; none come
        s.sendall(_head(b"transfer-encoding: chunked\r\n")
                  + b"%x\r\n%s\r\n" % (len(part), part) * 3)
        got = read_to_close(s)
    assert [status for status, _, _ in got] == [413]
    assert got[0][1][b"connection"] == b"close"


def test_a_small_rest_is_drained_and_the_next_request_served(base: str) -> None:
    body = b" " * (DRAIN_MAX_BYTES // 2)
    with _connect(base) as s:  # answered (404) before its body, which then comes
        s.sendall(_head(b"content-length: %d\r\n" % len(body))
                  .replace(b"/v1/chat/completions", b"/v1/nowhere"))
        answers = Answers()
        while not answers.got:
            answers.parser.feed_data(s.recv(65536))
        s.sendall(body + _head(b"content-length: %d\r\nconnection: close\r\n" % len(SMALL))
                  + SMALL)
        got = answers.got + read_to_close(s)
    assert [status for status, _, _ in got] == [404, 200]
    assert b"connection" not in got[0][1]


def test_a_large_body_read_whole_keeps_its_connection(base: str) -> None:
    """A body announced past `DRAIN_MAX_BYTES` that arrives whole before its answer keeps the
    keep-alive connection (told to close only while the body is due)."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 2, "pad": "p" * (LIMIT - 200)}).encode()
    assert DRAIN_MAX_BYTES < len(body) <= LIMIT
    with _connect(base) as s:
        s.sendall(_head(b"content-length: %d\r\n" % len(body)) + body
                  + _head(b"content-length: %d\r\nconnection: close\r\n" % len(SMALL)) + SMALL)
        got = read_to_close(s)
    assert [status for status, _, _ in got] == [200, 200], got


def _trickle_until_closed(s: socket.socket) -> tuple[int, list[int]]:
    """Send a byte every TRICKLE_S until a write fails (the gateway closed): how many bytes
    went, and the statuses answered meanwhile."""
    answers = Answers()
    s.settimeout(TRICKLE_S)
    for sent in range(TRICKLE_MAX):
        try:
            s.send(b" ")
        except OSError:
            return sent, [status for status, _, _ in answers.got]
        try:
            if chunk := s.recv(65536):
                answers.parser.feed_data(chunk)
        except TimeoutError:
            pass
        except OSError:
            return sent, [status for status, _, _ in answers.got]
        time.sleep(TRICKLE_S)
    return TRICKLE_MAX, [status for status, _, _ in answers.got]


@pytest.mark.parametrize(("head", "status"), [
    (_head(b"content-length: %d\r\n" % (4 << 20)), 413),  # keep-alive: told to close
    (_head(b"content-length: %d\r\nconnection: close\r\n" % (4 << 20)), 413),
    (_head(b"x-pad: " + b"p" * 8192 + b"\r\ncontent-length: 100\r\n"), 431),
])
def test_a_refused_client_trickling_its_body_is_closed_on(
    base: str, head: bytes, status: int,
) -> None:
    with _connect(base) as s:
        s.sendall(head)
        sent, statuses = _trickle_until_closed(s)
    assert statuses == [status]
    assert sent < TRICKLE_MAX, "the connection was still open"
    assert inflight(base) == 0
