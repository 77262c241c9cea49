"""The body of a request that asked to switch protocols, which the HTTP parser skips.

``curl --http2`` on an ``http://`` URL sends ``Connection: Upgrade, HTTP2-Settings`` and
``Upgrade: h2c`` on an ordinary POST with its JSON body. kvgate switches to nothing (RFC 9110
7.8: a server may ignore Upgrade and answer in HTTP/1.1), but httptools (llhttp) treats every
upgrade request as having no body: the request reached the app empty (a 400 "not valid JSON"
for a good request), and its body's bytes were dropped -- or, arriving in a later read, parsed
as the next request. `UpgradeBody` reads that body instead, framed as the request's headers
say (``Content-Length``, or chunked through a second parser), into the request's cycle as the
parser's own body callback would, so the app sees the request as sent.
"""

from __future__ import annotations

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = ["UpgradeBody"]


class UpgradeBody:
    """Feed bytes after an upgrade request's headers; `feed` returns the bytes after the body
    (the next request's), or None while the body goes on."""

    def __init__(self, cycle: RequestResponseCycle, headers: list[tuple[bytes, bytes]],
                 flow: FlowControl) -> None:
        self._cycle = cycle
        self._flow = flow
        self._left = 0  # Content-Length framing: bytes still to come
        self._chunks: httptools.HttpRequestParser | None = None  # chunked framing
        for name, value in headers:
            if name == b"content-length" and value.strip().isdigit():
                self._left = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                # a second parser reads the chunks: only its body callbacks are used, and
                # where they end in a read is not known, so the connection closes after
                self._chunks = httptools.HttpRequestParser(self)
                self._chunks.feed_data(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
                cycle.keep_alive = False
        self.done = self._chunks is None and self._left == 0
        cycle.more_body = not self.done

    def feed(self, data: bytes) -> bytes | None:
        if self._chunks is not None:
            try:
                self._chunks.feed_data(data)  # (bytes after the last chunk are dropped)
            except httptools.HttpParserError:
                if not self.done:
                    raise  # not chunked framing: the caller refuses it (400)
            return b"" if self.done else None
        part, rest = data[:self._left], data[self._left:]
        self._left -= len(part)
        self.on_body(part)
        if self._left == 0:
            self.on_message_complete()
            return rest
        return None

    # -- the chunk parser's callbacks --------------------------------------------------------
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
