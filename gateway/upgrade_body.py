"""The body of a request that asked to switch protocols, which the HTTP parser skips.

``curl --http2`` on an ``http://`` URL sends ``Connection: Upgrade, HTTP2-Settings`` and
``Upgrade: h2c`` on an ordinary POST with its JSON body. kvgate switches to nothing (RFC 9110
7.8: a server may ignore Upgrade and answer in HTTP/1.1), but httptools (llhttp) treats every
upgrade request as having no body: the request reached the app empty (a 400 "not valid JSON"
for a good request), and its body's bytes were dropped -- or, arriving in a later read, parsed
as the next request. `UpgradeBody` reads that body instead, framed as the request's headers
say (``Content-Length``, or chunked: `ChunkedBody`), into the request's cycle as the parser's
own body callback would, so the app sees the request as sent, and a request pipelined after
the body is parsed as the next one.
"""

from __future__ import annotations

from collections.abc import Callable

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = ["ChunkedBody", "UpgradeBody"]


class UpgradeBody:
    """Feed bytes after an upgrade request's headers; `feed` returns the bytes after the body
    (the next request's), or None while the body goes on."""

    def __init__(self, cycle: RequestResponseCycle, headers: list[tuple[bytes, bytes]],
                 flow: FlowControl) -> None:
        self._cycle = cycle
        self._flow = flow
        self._left = 0  # Content-Length framing: bytes still to come
        self._chunks: ChunkedBody | None = None  # chunked framing
        for name, value in headers:
            if name == b"content-length" and value.strip().isdigit():
                self._left = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                self._chunks = ChunkedBody(self.on_body)
        self.done = self._chunks is None and self._left == 0
        cycle.more_body = not self.done

    def feed(self, data: bytes) -> bytes | None:
        """Raises `httptools.HttpParserError` for bytes that are not chunked framing (the
        caller refuses the request: 400)."""
        if self._chunks is not None:
            rest = self._chunks.feed(data)
            if rest is not None:
                self.on_message_complete()
            return rest
        part, rest = data[:self._left], data[self._left:]
        self._left -= len(part)
        self.on_body(part)
        if self._left == 0:
            self.on_message_complete()
            return rest
        return None

    # -- the body's bytes, as the parser's callbacks take them ------------------------------
    def on_body(self, body: bytes) -> None:
        cycle = self._cycle
        if cycle.response_complete:  # answered before it was read (a 413): read and dropped,
            return  # as uvicorn's own callback does; held, it paused reading for good
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self._flow.pause_reading()  # as uvicorn's own body callback: the app's receive resumes
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        self.done = True
        self._cycle.more_body = False
        self._cycle.message_event.set()


_HEX = b"0123456789abcdefABCDEF"
MAX_LINE = 8192  # bytes of a chunk-size line (with its extensions), or of all trailer lines


class ChunkedBody:
    """Chunked framing (RFC 9112 7.1) read by hand, so that where the body ends in a read is
    known (a parser fed the chunks would not say): what follows is the next request's. As
    strict as the HTTP parser: CRLF line ends, a size in hex digits only, CRLF after each
    chunk's data; extensions and trailer fields are read and dropped."""

    def __init__(self, on_body: Callable[[bytes], None]) -> None:
        self._on_body = on_body
        self._line = b""  # a size or trailer line (or a chunk's closing CRLF) so far
        self._left = 0  # data bytes of the current chunk still to come
        self._state = "size"  # "size", "data", "crlf" (after the data), "trailers"
        self._trailers = 0  # trailer bytes so far

    def feed(self, data: bytes) -> bytes | None:
        """The bytes after the body once it ended, or None while it goes on."""
        at = 0
        while at < len(data):
            if self._state == "data":
                part = data[at:at + self._left]
                at += len(part)
                self._left -= len(part)
                self._on_body(part)
                if not self._left:
                    self._state = "crlf"
            elif self._state == "crlf":
                piece = data[at:at + 2 - len(self._line)]
                at += len(piece)
                self._line += piece
                if len(self._line) == 2:
                    if self._line != b"\r\n":
                        raise httptools.HttpParserError("no CRLF after a chunk's data")
                    self._line, self._state = b"", "size"
            else:
                end = data.find(b"\n", at)
                line = self._line + data[at:len(data) if end < 0 else end + 1]
                at = len(data) if end < 0 else end + 1
                if len(line) + self._trailers > MAX_LINE:
                    raise httptools.HttpParserError("chunk-size or trailer line too long")
                if end < 0:
                    self._line = line
                    continue
                self._line = b""
                if not line.endswith(b"\r\n"):
                    raise httptools.HttpParserError("a bare LF in chunked framing")
                if self._state == "trailers":
                    if line == b"\r\n":
                        return data[at:]  # the body is complete
                    self._trailers += len(line)
                    continue
                size = line[:-2].split(b";", 1)[0].rstrip(b" \t")
                if not size or len(size) > 16 or size.strip(_HEX):
                    raise httptools.HttpParserError("invalid chunk size")
                self._left = int(size, 16)
                self._state = "data" if self._left else "trailers"
        return None
