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
- answers **400** and closes when an HTTP/1.1 request carries no ``Host``, or any request more
  than one, or one whose value is no host (RFC 9112 3.2; `gateway.head_checks`);
- answers **505** and closes when the request line names another version than HTTP/1.0 or
  HTTP/1.1 (``HTTP/2.0``, ``HTTP/0.9``): the parser took them for HTTP/1.x and they were
  served; so does a connection's first request line without a version (HTTP/0.9's
  ``GET /path``), once its line ends: it waited for the header timeout's 408;
- answers **501** (RFC 9112 6.1: a transfer coding the server does not understand) and closes
  when ``Transfer-Encoding`` names compressions before ``chunked`` (``gzip, chunked``): the
  parser undoes the chunked framing only, and the app would read the compressed bytes as the
  JSON body (a 400 about bytes the client never wrote). ``x-should-retry: false``: the SDKs
  retry a 5xx, and this one would come back the same; any other list than one ``chunked``
  (``identity, chunked``, ``chunked`` twice, not ending in it, or in an HTTP/1.0 request)
  is a **400** before its body, and closes (RFC 9112 6.3; `gateway.head_checks`);
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
- closes lingering (our side closed, what the client still sends read and dropped until it
  is quiet, as after the guard's own refusals: `gateway.pipelining`) a connection that closes
  after an answer the app gives while the request's body is still arriving (a 413 to a client
  that sent ``Connection: close``, or HTTP/1.0): uvicorn closed it at once, and the client,
  still writing its body, was reset; a keep-alive connection reads the rest and goes on when
  at most `DRAIN_MAX_BYTES` are due, else its answer says ``Connection: close`` and it closes
  lingering alike. A lingering close is bounded (`LINGER_MAX_S`, `LINGER_MAX_BYTES`);
- resets the connection of a client that keeps it open but takes no byte of an answer written
  in full (still in the transport's buffer) for `write_timeout_s` (`gateway.writewatch`).

Idle keep-alive connections between requests are uvicorn's `timeout_keep_alive` as before.

`GuardedHttpTools` is one protocol class built in layers, each a module named for what it does
(bottom up): `gateway.head_checks` (the head's limits and checks, the parser's callbacks, the
connection's state), `gateway.read_timeouts` (the 408s), `gateway.pipelining` (a refusal's and
a pipelined body timer's turn), `gateway.refusals` (the answers) and, here, the connection's
reads, its EOF and an upgrade request's body. What every answer gets is `gateway.edge_answers`;
the limits and the scope extensions the app reads are `gateway.guard_api`.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, cast

import httptools

from gateway.edge_answers import NoDelayHttpTools, date_header
from gateway.guard_api import ABORT, REFUSED, HttpLimits, abort_client, refused_status
from gateway.refusals import Refusals
from gateway.upgrade_body import UpgradeBody

__all__ = ["ABORT", "REFUSED", "HttpLimits", "NoDelayHttpTools", "abort_client", "date_header",
           "guarded_protocol", "refused_status"]


class GuardedHttpTools(Refusals):
    """uvicorn's httptools protocol under the guard's limits (module docstring)."""

    def __init__(self, *args: Any, limits: HttpLimits | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits or HttpLimits()
        self.write_timeout_s = self.limits.write_timeout_s

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
            self._dropped(len(data))  # lingering (`_linger`): read and dropped, bounded
            return
        self._unset_keepalive_if_required()
        if self._upgrade_body is not None:
            rest = self._feed_upgrade_body(self._upgrade_body, data)
            if not rest:
                return
            data = rest  # a pipelined request after the body
        # (the connection's first line only: later reads skip both checks)
        if (self._opening is not None or self._first_line is not None) \
                and self._refused_opening(data):
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

    def _feed_upgrade_body(self, body: UpgradeBody, data: bytes) -> bytes | None:
        """Feed a read to an upgrade request's body; the bytes after the body's end (a
        pipelined request), or None while it goes on or once it was refused."""
        try:
            rest = body.feed(data)
        except httptools.HttpParserError:
            self._refuse(400, "The request is not valid HTTP/1.1.")
            return None
        if rest is None:
            return None
        self._upgrade_body = None
        self._disarm()
        # the next request's headers, timed and counted from its first byte as after any
        # request (`on_message_complete` ran before the body, when the parser stopped)
        self._in_headers = True
        return rest

    def _refused_opening(self, data: bytes) -> bool:
        """Whether the connection's first bytes were refused: HTTP/0.9's request line (505);
        HTTP/2's preface is watched for here and refused where the parser stops at it."""
        if self._opening is not None:
            self._watch_opening(data)
        if self._first_line is not None and self._simple_request(data):
            self._refuse(505, "HTTP/0.9 is not supported: kvgate serves HTTP/1.1 (and "
                              "HTTP/1.0).")
            return True
        return False

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


def guarded_protocol(limits: HttpLimits) -> type[GuardedHttpTools]:
    """The protocol factory for uvicorn's `http=` with these limits: a `partial` of a
    module-level class, so a config holding it can be pickled (uvicorn's worker processes)."""
    return cast(type[GuardedHttpTools], functools.partial(GuardedHttpTools, limits=limits))
