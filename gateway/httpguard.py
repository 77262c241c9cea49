"""The HTTP/1.1 protocol kvgate serves with: uvicorn's httptools protocol, bounded.

uvicorn's httptools protocol has no limit on request headers and no read timeouts: an 8 MiB
header or 100,000 headers are parsed and handed to the app, and a client that sends its
headers (or its body) a byte at a time holds its connection forever. `guarded_protocol`
returns a subclass that

- answers **431** and closes when the request line and headers exceed `max_header_bytes`
  (counted as they arrive, so at most one socket read beyond the limit is ever buffered) or
  carry more than `max_headers` header fields;
- answers **408** and closes when a request's headers are not complete `header_timeout_s`
  after its first byte arrived (or after the connection opened), or its body is not complete
  `body_timeout_s` after its headers (the app sees the client leave: ``http.disconnect``);
- drops the trailer fields of a chunked body (counted within the header limits): uvicorn
  appended them to the request's headers, so a trailer ``Authorization`` authenticated it;
- answers **400** in OpenAI's shape (not uvicorn's text/plain page) and closes when the bytes
  are not HTTP/1.1 (a malformed request line or header, a path that is not UTF-8, conflicting
  ``Content-Length``/``Transfer-Encoding``, TLS spoken to the plain port);
- answers a connection opening with HTTP/2's preface (a client with prior knowledge: `curl
  --http2-prior-knowledge`, httpx with ``http1=False``) in HTTP/2, which is all it can read:
  the server's preface (an empty SETTINGS frame) and GOAWAY with ``HTTP_1_1_REQUIRED`` (RFC
  9113 3.4 and 7), then closes. An HTTP/1.1 400 reached such a client as "Empty reply from
  server" (curl) or a frame-size error about the bytes ``HTTP/1.1 4`` (h2 libraries);
- answers **505** and closes when the request line names another version than HTTP/1.0 or
  HTTP/1.1 (``HTTP/2.0``, ``HTTP/0.9``): the parser took them for HTTP/1.x and they were
  served; so does a connection's first request line without a version (HTTP/0.9's
  ``GET /path``), once its line ends: it waited for the header timeout's 408;
- answers **501** (RFC 9112 6.1: a transfer coding the server does not understand) and closes
  when ``Transfer-Encoding`` names a coding other than ``chunked`` (``gzip, chunked``): the
  parser undoes the chunked framing only, and the app would read the compressed bytes as the
  JSON body (a 400 about bytes the client never wrote). ``x-should-retry: false``: the SDKs
  retry a 5xx, and this one would come back the same;
- gives each of those refusals the CORS headers kvgate's other answers carry
  (``Access-Control-Allow-Origin``, ...) when the request's ``Origin`` arrived before the
  refusal and is allowed (`server.cors_*`, never on the admin port: the app's `refusal_cors`),
  so a browser client sees the status instead of an opaque network error;
- sets TCP_NODELAY on every accepted socket (small SSE writes must not wait for delayed ACKs);
- sends no ``100 Continue`` to an HTTP/1.0 client that sent ``Expect: 100-continue`` (RFC
  9110: ignored in an HTTP/1.0 request);
- sends a ``Date`` header on every answer (RFC 9110 8.6.1: an origin server with a clock
  SHOULD), computed once a second; uvicorn's own (``date_header``) stays off, as does its
  ``Server: uvicorn`` (kvgate names no software in its answers);
- puts ``scope["extensions"]["kvgate.abort"]`` into each request's scope: a callable that
  resets the connection and marks the request disconnected, so an app that gives up on an
  unfinished response (a client that stopped reading) returns without uvicorn's ERROR line;
- answers **400** and closes when a client shuts its sending side before its headers or its
  body ended (no blank line after the headers, ``Content-Length`` larger than what it sent, no
  last chunk): uvicorn closed without a byte;
- answers a client that half-closes its side after a whole HTTP/1.1 request
  (``shutdown(SHUT_WR)``: its end of the request, not of the connection; uvicorn took the EOF
  for a disconnect, and the app cancelled the request: the client got nothing). Its FIN looks
  the same as a client that closed its socket and left (an SDK's timeout), whose request must
  not run on: so the connection is kept open for the answer and probed at once, then every
  `REPROBE_S` until the answer starts, with an interim ``100 Continue`` (RFC 9110 15.2: a
  client must parse an unexpected 1xx): a client gone resets it (its kernel answers the probe
  with a RST), and the request is then a client gone as before (``http.disconnect``),
  `PROBE_S` later; once the answer runs, its own writes fail the same way (a stream quiet
  for `REPROBE_S` gets an SSE comment line that probes as the 100 does). The connection
  closes after the answer.
  Pipelined requests sent before the half-close are answered in turn, the connection closed
  after the last (no 100 goes out while an earlier answer is being written). A request cut
  short by the EOF gets its 400 (above; behind a pipelined answer still due: a client gone),
  and an answer already under way (a client leaving a stream it read in part), or an
  HTTP/1.0 request (no 1xx may go to it) is a client gone at once, as before;
- resets the connection of a client that keeps it open but takes no byte of an answer written
  in full (still in the transport's buffer) for `write_timeout_s` (`gateway.writewatch`).

Idle keep-alive connections between requests are uvicorn's `timeout_keep_alive` as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any, cast

import httptools
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.errors import error_body
from gateway.halfclose import HalfCloseProbe
from gateway.parse_reasons import not_http_message
from gateway.upgrade_body import UpgradeBody
from gateway.writewatch import WriteWatch

__all__ = ["ABORT", "REFUSED", "HttpLimits", "abort_client", "date_header", "guarded_protocol",
           "refused_status"]

Header = tuple[bytes, bytes]

ABORT = "kvgate.abort"  # the scope extension holding a request's abort callable
REFUSED = "kvgate.refused"  # the scope extension: the status the guard answered it with


def refused_status(scope: dict[str, Any]) -> int | None:
    """The status the guard answered a request with itself while its body was due (408: too
    slow; 400: cut short): what the client got, for the app's count of a request it then sees
    gone (a 499 otherwise)."""
    status: int | None = scope.get("extensions", {}).get(REFUSED)
    return status


def abort_client(scope: dict[str, Any]) -> None:
    """Reset the connection of a client that stopped reading its stream: nothing more can be
    sent, and the unfinished answer is a client gone, not an app error, to the server."""
    abort = scope.get("extensions", {}).get(ABORT)
    if abort is not None:
        abort()


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 120.0  # an answer's buffered bytes unread this long (`writewatch`)


_KINDS = {400: "BadRequestError", 408: "RequestTimeoutError",
          431: "RequestHeaderFieldsTooLargeError", 501: "NotImplementedError",
          505: "HTTPVersionNotSupportedError"}
# what the SDKs would retry in vain
_UNRETRIED = {501: [(b"x-should-retry", b"false")], 505: [(b"x-should-retry", b"false")]}
_VERSIONS = frozenset({"1.0", "1.1"})  # the request-line versions served
MAX_LINE = 8192  # bytes of a first request line kept to see whether it names a version
_SIMPLE = re.compile(rb"[A-Z]+ [!-~]+")  # METHOD SP TARGET: HTTP/0.9's request line
_FRAMINGS = frozenset({b"chunked", b"identity"})  # transfer codings the body is read with
LINGER_S = 2.0  # a refused connection is read (and dropped) this long before it is closed
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # RFC 9113 3.4: an h2 client's first bytes
H2_GOAWAY_DEBUG = b"This server speaks HTTP/1.1 only; send the request without HTTP/2."
# RFC 9113 4.1 frames: the server's preface (an empty SETTINGS), then GOAWAY (type 7) with last
# stream 0 (no stream was processed) and error HTTP_1_1_REQUIRED (0xd), its debug data a text
H2_REFUSAL = (b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
              + (8 + len(H2_GOAWAY_DEBUG)).to_bytes(3, "big") + b"\x07\x00\x00\x00\x00\x00"
              + (0).to_bytes(4, "big") + (0xD).to_bytes(4, "big") + H2_GOAWAY_DEBUG)


_date: tuple[int, list[Header]] = (0, [])


def date_header() -> list[Header]:
    """``[(b"date", <IMF-fixdate of now>)]``, the same list object within a second (uvicorn
    copies its default headers into each answer; nothing mutates it)."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, [(b"date", formatdate(now, usegmt=True).encode())])
    return _date[1]


class _StopParsing(Exception):
    """A request refused from a parser callback (too many or too large headers, a transfer
    coding not undone): raised to stop parsing at once."""


class NoDelayHttpTools(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # OSError: not a TCP socket (e.g. a unix socket)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None:  # every answer gets a Date (uvicorn's `date_header` is off)
            extra = cycle.default_headers
            cycle.default_headers = [*date_header(), *extra] if extra else date_header()
            if cycle.scope.get("http_version") == "1.0":
                _close_delimited(cycle)
                # RFC 9110 10.1.1 and 15.2: an HTTP/1.0 request's 100-continue is ignored (no
                # 1xx may go to an HTTP/1.0 client; uvicorn sent one at the first read)
                cycle.waiting_for_100_continue = False
            if cycle.waiting_for_100_continue:
                _close_if_unasked(cycle)


def _close_if_unasked(cycle: RequestResponseCycle) -> None:
    """A request with ``Expect: 100-continue`` answered before its body was asked for (401,
    413, 429, ...): the client holds the body back, and whether it will send it after a final
    answer is its choice, so the connection cannot carry a next request -- kept open, a next
    request's bytes would be read as this body's and never answered. The answer says
    ``Connection: close`` and the connection closes after it (RFC 9110 10.1.1: a server
    answering before the content says whether it keeps reading)."""
    send = cycle.send

    async def send_then_close(message: Any) -> None:
        # (`more_body` false: no body, or all of it came without waiting: nothing held back)
        if (message["type"] == "http.response.start" and cycle.waiting_for_100_continue
                and cycle.more_body):
            cycle.keep_alive = False  # uvicorn then writes `connection: close` and closes
        await send(message)

    cycle.send = send_then_close  # type: ignore[method-assign]


# more than any body: the close-delimited answer's bytes are not counted (`_close_delimited`)
_UNCOUNTED = 1 << 62


def _close_delimited(cycle: RequestResponseCycle) -> None:
    """An HTTP/1.0 client cannot read chunked framing (RFC 9112 6.1: a server must not send
    Transfer-Encoding to one), which uvicorn uses for any answer without a Content-Length (a
    stream): for such a request an answer without one is delimited by closing the
    connection instead (uvicorn closes it after an HTTP/1.0 answer anyway). The cycle's
    `send` is replaced before the app is run (`run_asgi` reads it when the task starts)."""
    send = cycle.send

    async def send_close_delimited(message: Any) -> None:
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", ())}
            if b"content-length" not in names and b"transfer-encoding" not in names:
                cycle.chunked_encoding = False  # uvicorn then writes the body as it comes
                cycle.expected_content_length = _UNCOUNTED
        elif (cycle.expected_content_length >= _UNCOUNTED // 2
              and not message.get("more_body", False)):
            cycle.expected_content_length = len(message.get("body", b""))  # its last part
        await send(message)

    cycle.send = send_close_delimited  # type: ignore[method-assign]


class GuardedHttpTools(HalfCloseProbe, WriteWatch, NoDelayHttpTools):
    def __init__(self, *args: Any, limits: HttpLimits | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits or HttpLimits()
        self.write_timeout_s = self.limits.write_timeout_s

    _in_headers = True  # between a request's first byte and its complete headers
    _header_bytes = 0
    _header_count = 0
    # request line and headers as the parser hands them over: one read may hold a whole
    # request, whose headers are then complete before `data_received` could count them
    _parsed_bytes = 0
    _timer: asyncio.TimerHandle | None = None
    _origin: bytes | None = None  # the current request's Origin header, once parsed
    _coding: bytes | None = None  # a transfer coding the parser would not undo (`on_header`)
    _upgrade_body: UpgradeBody | None = None  # reading an upgrade request's body
    _version: str | None = None  # a request line's HTTP version not served (`HTTP/2.0`)
    _first_line: bytes | None = b""  # the connection's first bytes until their first LF
    _opening: bytes | None = b""  # the connection's first bytes while they may be H2_PREFACE
    _begun = False  # the parser is inside a request (`on_message_begin`), not between two
    _deferred: bytes | None = None  # a refusal waiting for earlier answers (`_answer_and_close`)

    # -- connection ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, self._header_timeout)  # silent openers too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio's signature
        """A client that shuts its sending side while its headers or body are still due (no
        blank line after the headers, fewer bytes than its ``Content-Length``, no last chunk)
        left a request that can never end: it is told so (400) instead of closed on without a
        byte, and the app sees it gone (nothing was sent upstream). Not while an earlier
        pipelined answer is due: the 400 would come first."""
        cycle, running = self.cycle, self._running
        if self._deferred is not None:
            return True  # a half-close after a refused pipelined head: the answers still go
        due = running is not None and not running.response_complete  # an answer to come
        if self._refused or (due and running is not cycle):
            return super().eof_received()
        if self._in_headers and self._header_bytes and not due:  # (none: an idle connection)
            self._refuse(400, "The request headers ended before the blank line that ends "
                              "them: the client closed its side of the connection.")
            return True  # open for the answer: `_refuse` closes it
        if cycle is not None and cycle.more_body and not cycle.response_started:
            cycle.disconnected = True  # the app's receive() answers http.disconnect
            cycle.message_event.set()
            self._refuse(400, "The request body ended before its declared end (its "
                              "Content-Length, or the last chunk): the client closed its "
                              "side of the connection.")
            return True
        return super().eof_received()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # draining a refused request (see `_refuse`)
        self._unset_keepalive_if_required()
        if self._upgrade_body is not None:
            try:
                rest = self._upgrade_body.feed(data)
            except httptools.HttpParserError:
                self._refuse(400, "The request is not valid HTTP/1.1.")
                return
            if rest is None:
                return
            self._upgrade_body = None
            self._disarm()
            # the next request's headers, timed and counted from its first byte as after any
            # request (`on_message_complete` ran before the body, when the parser stopped)
            self._in_headers = True
            if not rest:
                return
            data = rest  # a pipelined request after the body
        if self._opening is not None:
            self._watch_opening(data)
        if self._first_line is not None and self._simple_request(data):
            self._refuse(505, "HTTP/0.9 is not supported: kvgate serves HTTP/1.1 (and "
                              "HTTP/1.0).")
            return
        if self._in_headers:
            self._header_bytes += len(data)
            if self._timer is None:
                self._arm(self.limits.header_timeout_s, self._header_timeout)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # no WebSocket route (`ws="none"`), no h2c: answered as plain HTTP, with the body
            # the parser skipped (`gateway.upgrade_body`). uvicorn's own warning here ("install
            # websockets") would be wrong, and one line per request a client can repeat at will
            self.logger.debug("upgrade request answered as plain HTTP")
            self._read_upgrade_body(data[upgrade.args[0]:])
            return
        except httptools.HttpParserError as error:
            self._refuse_unparsed(error, data)
            return
        if self._in_headers and self._header_bytes > self.limits.max_header_bytes:
            self._refuse(431, "The request headers exceed "
                              f"{self.limits.max_header_bytes} bytes.")

    def _refuse_unparsed(self, error: httptools.HttpParserError, data: bytes) -> None:
        """Answer bytes the parser refused (`data`: the read it failed in)."""
        if self._origin is None:  # the parser hands a header over only once it ended
            self._origin = _scan_origin(data)
        if self._opening is not None:  # the parser stopped at HTTP/2's preface
            self._refuse_http2()
        elif self._version is not None:
            self._refuse(505, f"HTTP/{self._version} is not supported: kvgate serves "
                              "HTTP/1.1 (and HTTP/1.0).")
        elif self._coding is not None:
            self._refuse(501, f"Transfer-Encoding {self._coding.decode('latin-1')!r} is not "
                              "supported (only chunked); send the body uncompressed.")
        elif self._header_count > self.limits.max_headers:
            self._refuse(431, f"More than {self.limits.max_headers} request headers.")
        elif self._parsed_bytes > self.limits.max_header_bytes:
            self._refuse(431, "The request headers exceed "
                              f"{self.limits.max_header_bytes} bytes.")
        else:  # uvicorn's own answer here is a text/plain page
            # (a callback's error names our code, not the request: no reason then)
            callback = isinstance(error, httptools.HttpParserCallbackError)
            reason = str(error.args[0]) if error.args and not callback else ""
            self._refuse(400, not_http_message(reason))

    def _watch_opening(self, data: bytes) -> None:
        """Keep the connection's first bytes while they are a prefix of HTTP/2's preface."""
        opening = (cast(bytes, self._opening) + data[:len(H2_PREFACE)])[:len(H2_PREFACE)]
        self._opening = opening if H2_PREFACE.startswith(opening) else None

    def _simple_request(self, data: bytes) -> bool:
        """Whether the connection's first request line, once whole, has no HTTP version: an
        HTTP/0.9 request (``GET /path``), which the parser took for one whose headers were
        still due, answered 408 at the header timeout. (Only the first: such a client sends
        one request per connection.)"""
        line = cast(bytes, self._first_line) + data[:MAX_LINE]
        end = line.find(b"\n")
        if end < 0:
            self._first_line = line if len(line) < MAX_LINE else None
            return False
        self._first_line = None
        return _SIMPLE.fullmatch(line[:end].rstrip(b"\r")) is not None

    def _read_upgrade_body(self, rest: bytes) -> None:
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:
            return
        body = UpgradeBody(cycle, self.headers, self.flow)
        if body.done:
            if rest:
                self.data_received(rest)  # a pipelined request
            return
        self._upgrade_body = body
        self._in_headers = False
        self._arm(self.limits.body_timeout_s, self._body_timeout)
        if rest:
            self.data_received(rest)

    # -- parser callbacks ----------------------------------------------------------------
    def on_message_begin(self) -> None:
        # a head begun in the read that ended the request before it (pipelined) is timed
        # from here: `data_received` saw those bytes as the earlier body's, and nothing timed
        # them until more came (the keep-alive timeout, 120 s, and no 408)
        self._begun = True
        if self._timer is None:
            self._arm(self.limits.header_timeout_s, self._header_timeout)
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._parsed_bytes += len(url)
        if self._parsed_bytes > self.limits.max_header_bytes:
            raise _StopParsing
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 6 and name.lower() == b"origin":  # for a refusal's CORS headers
            self._origin = value
        self._header_count += 1
        self._parsed_bytes += len(name) + len(value) + 4  # ": " and CRLF
        if (self._header_count > self.limits.max_headers
                or self._parsed_bytes > self.limits.max_header_bytes):
            raise _StopParsing
        if not self._in_headers:
            # a trailer field (after a chunked body's last chunk), counted above so trailers
            # stay bounded: never merged into the request's headers (RFC 9110 6.5.1), where
            # uvicorn put it -- an `Authorization` in a trailer authenticated the request,
            # unseen by any proxy in front that checks headers
            return
        if len(name) == 17 and name.lower() == b"transfer-encoding":
            self._coding = _unframed(value)
            if self._coding is not None:
                raise _StopParsing  # stops the parser: refused as a 501 (`data_received`)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.parser.get_http_version() not in _VERSIONS:
            # `HTTP/2.0` or `HTTP/0.9` on a request line: read as HTTP/1.x and answered, a
            # front proxy reading it otherwise would disagree on where requests end
            self._version = self.parser.get_http_version()
            raise _StopParsing  # refused as a 505 (`data_received`), before any app runs
        self._in_headers = False
        self._disarm()
        self._arm(self.limits.body_timeout_s, self._body_timeout)
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:  # not an upgrade: a new request
            scope = cast(dict[str, Any], cycle.scope)
            scope.setdefault("extensions", {})[ABORT] = functools.partial(self._abort, cycle)

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_headers = True  # the next request's headers (its timer starts with its data)
        self._begun = False
        self._header_bytes = self._header_count = self._parsed_bytes = 0
        self._origin = self._coding = None
        super().on_message_complete()

    # -- timers and refusals -------------------------------------------------------------
    def _arm(self, delay: float, callback: object) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, callback)  # type: ignore[arg-type]

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        if self._in_headers and not self.transport.is_closing():
            if self._header_bytes or self._begun or self.cycle is None:
                self._refuse(408, "The request headers did not arrive in time.")
            else:
                self.transport.close()  # an idle keep-alive connection: nothing was asked

    def _body_timeout(self) -> None:
        self._timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or self.transport.is_closing():
            return
        running = self._running
        if running is not None and running is not cycle and not running.response_complete:
            # pipelined behind an answer still due: uvicorn stopped reading, so its body cannot
            # arrive; timed again when its turn comes (`on_response_complete`). The 408 went
            # out in the middle of the earlier answer (a stream cut, its chunks corrupted)
            return
        started = cycle.response_started
        cycle.disconnected = True  # the app's receive() now answers http.disconnect
        cycle.message_event.set()
        if started:
            self.transport.close()
        else:
            self._refuse(408, "The request body did not arrive in time.")

    def _refuse(self, status: int, message: str) -> None:
        """Answer `status` with an OpenAI-shaped error, then close the connection
        (`_answer_and_close`)."""
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_started:
            scope = cast(dict[str, Any], cycle.scope)  # its body was due: the app runs it
            scope.setdefault("extensions", {})[REFUSED] = status
        kind = _KINDS[status]
        body = error_body(message, kind, status)
        extra = b"".join(k + b": " + v + b"\r\n" for k, v in [
            *date_header(), *self._cors(), *_UNRETRIED.get(status, ())])
        self._answer_and_close(b"".join([
            STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: ", str(len(body)).encode(), b"\r\n", b"connection: close\r\n",
            extra, b"\r\n", body,
        ]))
        self.logger.info("request refused: %s", message)

    def _refuse_http2(self) -> None:
        """Tell an HTTP/2 client with prior knowledge, in HTTP/2, to use HTTP/1.1."""
        self._answer_and_close(H2_REFUSAL)
        self.logger.info("request refused: HTTP/2 with prior knowledge (answered GOAWAY "
                         "HTTP_1_1_REQUIRED)")

    def _answer_and_close(self, answer: bytes) -> None:
        """Write a refusal, then close: a lingering close (our side half-closed, what the
        client still sends read and dropped, for at most `LINGER_S`), so a client still
        sending gets the answer instead of a reset. A refusal of a request head read behind
        requests still to be answered (pipelined: a miscounted `Content-Length` leaves bytes
        that are no request) waits for their answers: written at once, it cut them off (the
        client got the 400 alone, its valid request ran upstream for nothing, a 499)."""
        self._disarm()
        self._refused = True
        if self._in_headers and self._answers_due():
            self._deferred = answer  # written by `on_response_complete` once they are
            return
        self.transport.write(answer)
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _answers_due(self) -> bool:
        running = self._running
        return bool(self.pipeline) or (running is not None and not running.response_complete)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if cycle is not None and cycle is self._running and cycle.more_body and not (
                cycle.response_complete or self._refused):
            self._arm(self.limits.body_timeout_s, self._body_timeout)  # a pipelined one's turn
        answer = self._deferred
        if answer is None or self._answers_due() or self.transport.is_closing():
            return
        self._deferred = None
        if self.timeout_keep_alive_task is not None:  # armed by uvicorn: closing now anyway
            self.timeout_keep_alive_task.cancel()
        self._answer_and_close(answer)

    def _cors(self) -> list[Header]:
        """The CORS headers for the refused request's ``Origin``, asked of the app served
        (`GatewayApp.refusal_cors`: its `server.cors_*`, none on the admin port)."""
        origin = self._origin
        find: Callable[[bytes, int | None], list[Header] | None] | None = getattr(
            self.config.app, "refusal_cors", None)
        if origin is None or find is None:
            return []
        local = self.server
        return find(origin, local[1] if local else None) or []


def _unframed(value: bytes) -> bytes | None:
    """The first coding of a ``Transfer-Encoding`` value other than chunked framing."""
    for coding in value.split(b","):
        coding = coding.strip().lower()
        if coding and coding not in _FRAMINGS:
            return coding[:40]
    return None


def _scan_origin(data: bytes) -> bytes | None:
    """The value of an ``Origin:`` header line in `data` (bytes that failed to parse)."""
    start = data.lower().find(b"\norigin:")
    if start < 0:
        return None
    end = data.find(b"\n", start + 1)
    value = data[start + 8: end if end >= 0 else len(data)].strip()
    return value or None


def guarded_protocol(limits: HttpLimits) -> type[GuardedHttpTools]:
    """The protocol factory for uvicorn's `http=` with these limits: a `partial` of a
    module-level class, so a config holding it can be pickled (uvicorn's worker processes)."""
    return cast(type[GuardedHttpTools], functools.partial(GuardedHttpTools, limits=limits))
