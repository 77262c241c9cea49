"""HTTP/1.1 answers read off a raw socket, for tests that send bytes no client library would
(malformed heads, pipelined requests, bodies cut short)."""

from __future__ import annotations

import socket

import httptools

__all__ = ["Answers", "exchange", "read_to_close"]

Answer = tuple[int, dict[bytes, bytes], bytes]  # status, headers (lower-cased names), body


class Answers:
    """The answers read on one connection, parsed in order."""

    def __init__(self) -> None:
        self.got: list[Answer] = []
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.got.append((self.parser.get_status_code(), self._headers, b"".join(self._body)))
        self._headers, self._body = {}, []


def read_to_close(s: socket.socket) -> list[Answer]:
    """Every answer until the gateway closes (a socket timeout fails the test)."""
    answers = Answers()
    s.settimeout(30)
    while chunk := s.recv(65536):
        answers.parser.feed_data(chunk)
    return answers.got


def exchange(port: int, data: bytes, *, half_close: bool = False) -> list[tuple[int, bytes]]:
    """`data` sent on a new connection to 127.0.0.1:`port` (then, with `half_close`, its
    sending side shut); (status, body) of every answer until the gateway closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        return [(status, body) for status, _, body in read_to_close(s)]
