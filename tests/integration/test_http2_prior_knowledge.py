"""An HTTP/2 client with prior knowledge (`curl --http2-prior-knowledge`, httpx with
``http1=False``, gRPC-style clients, a proxy configured for h2c upstreams) speaks HTTP/2 from
its first byte and cannot read an HTTP/1.1 answer: curl said "Empty reply from server" and
h2 libraries a framing error about the bytes ``HTTP/1.1 400``. kvgate answers in HTTP/2's own
terms instead: its connection preface, then GOAWAY with HTTP_1_1_REQUIRED (RFC 9113 7), and
closes. Real gateway, raw sockets."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest

from tests.support.gateway import gateway_proc

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame, stream 0
GOAWAY, SETTINGS_TYPE, HTTP_1_1_REQUIRED = 0x7, 0x4, 0xD


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    gw, base = gateway_proc(upstreams=["http://127.0.0.1:9"], ready=False)
    with gw:
        yield int(base.rsplit(":", 1)[1])


def _frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(type, stream id, payload) of each HTTP/2 frame in `data` (RFC 9113 4.1)."""
    frames = []
    while data:
        assert len(data) >= 9, data
        length = int.from_bytes(data[:3], "big")
        kind, stream = data[3], struct.unpack(">I", data[5:9])[0] & 0x7FFFFFFF
        frames.append((kind, stream, data[9:9 + length]))
        data = data[9 + length:]
    return frames


@pytest.mark.parametrize("writes", [
    [PREFACE + SETTINGS],  # as clients send it: the preface and their SETTINGS at once
    [PREFACE[:16], PREFACE[16:] + SETTINGS],  # the preface split across TCP writes
], ids=["one-write", "split"])
def test_an_http2_prior_knowledge_client_is_told_to_use_http_1_1(
    port: int, writes: list[bytes],
) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for data in writes:
            s.sendall(data)
        raw = b""
        while chunk := s.recv(65536):  # the gateway closes the connection after its GOAWAY
            raw += chunk
    assert not raw.startswith(b"HTTP/1.1"), raw[:80]
    frames = _frames(raw)
    assert [(kind, stream) for kind, stream, _ in frames] == [(SETTINGS_TYPE, 0), (GOAWAY, 0)]
    last_stream, error = struct.unpack(">II", frames[1][2][:8])
    assert (last_stream, error) == (0, HTTP_1_1_REQUIRED)  # no stream was processed
    assert b"HTTP/1.1" in frames[1][2][8:]  # debug data a client may show


def test_a_request_with_the_pri_method_is_still_http_1_1(port: int) -> None:
    """Only HTTP/2's preface is answered in HTTP/2: other bytes that are not HTTP/1.1 get the
    OpenAI-shaped 400 as before."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"PRI /v1/models HTTP/2.0\r\nHost: x\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    assert raw.startswith(b"HTTP/1.1 "), raw[:80]
