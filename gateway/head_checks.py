"""A request head as the HTTP guard reads it (`gateway.httpguard`): counted and bounded as the
parser hands it over (431), its version (505 for one not served, HTTP/0.9's line without one),
its transfer codings (anything but one ``chunked``: 400 where the body's end is unclear, 501
for a compression before chunked; `_framing_fault`), its ``Host`` (400 for none on an
HTTP/1.1 request, more than one, or a value that is no host), a chunked body's trailer fields
kept out of its headers, its ``Origin`` kept for a refusal's CORS headers, HTTP/2's preface
told apart, and bytes the parser refuses answered with the reason (400, `parse_reasons`).

`HeadChecks` is the bottom layer of `GuardedHttpTools` and holds the connection's state that
all its layers share; the parser calls its callbacks on every request, so they sit right
above uvicorn's protocol, as they did in the one class.
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import TYPE_CHECKING, Any, cast

import httptools

from gateway.edge_answers import NoDelayHttpTools
from gateway.guard_api import ABORT, HttpLimits
from gateway.halfclose import HalfCloseProbe
from gateway.parse_reasons import not_http_message
from gateway.upgrade_body import UpgradeBody
from gateway.writewatch import WriteWatch

__all__ = ["H2_PREFACE", "MAX_LINE", "HeadChecks"]

_VERSIONS = frozenset({"1.0", "1.1"})  # the request-line versions served
MAX_LINE = 8192  # bytes of a first request line kept to see whether it names a version
_SIMPLE = re.compile(rb"[A-Z]+ [!-~]+")  # METHOD SP TARGET: HTTP/0.9's request line
# codings a client may put before chunked that say where nothing ends: refused 501 (RFC 9112
# 6.1: a coding not implemented), the body's end being clear. Any other list is a 400
_COMPRESSIONS = frozenset({b"gzip", b"x-gzip", b"deflate", b"compress", b"x-compress", b"br",
                           b"zstd"})
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # RFC 9113 3.4: an h2 client's first bytes
# RFC 3986's host [":" port] (a name, an IPv4 address or a bracketed IPv6 literal), or empty;
# raw UTF-8 is none (IDNs travel as punycode; Go's net/http refuses it alike)
_HOST = re.compile(rb"[A-Za-z0-9._~%!$&'()*+,;=\[\]:-]*")


class _StopParsing(Exception):
    """A request refused from a parser callback (too many or too large headers, a transfer
    coding not undone): raised to stop parsing at once."""


class HeadChecks(HalfCloseProbe, WriteWatch, NoDelayHttpTools):
    """The request head's checks, and the state of a guarded connection (module docstring)."""

    limits: HttpLimits  # set by `GuardedHttpTools.__init__`
    _in_headers = True  # between a request's first byte and its complete headers
    _header_bytes = 0
    _header_count = 0
    # request line and headers as the parser hands them over: one read may hold a whole
    # request, whose headers are then complete before `data_received` could count them
    _parsed_bytes = 0
    _timer: asyncio.TimerHandle | None = None
    _origin: bytes | None = None  # the current request's Origin header, once parsed
    _codings: list[bytes] | None = None  # the request's Transfer-Encoding list, all its lines
    _length: int | None = None  # its Content-Length (the parser refuses two that differ)
    _coding_fault: tuple[int, str] | None = None  # its refusal (`_framing_fault`)
    _upgrade_body: UpgradeBody | None = None  # reading an upgrade request's body
    _version: str | None = None  # a request line's HTTP version not served (`HTTP/2.0`)
    _first_line: bytes | None = b""  # the connection's first bytes until their first LF
    _opening: bytes | None = b""  # the connection's first bytes while they may be H2_PREFACE
    _begun = False  # the parser is inside a request (`on_message_begin`), not between two
    _deferred: bytes | None = None  # a refusal waiting for earlier answers (`_answer_and_close`)
    _hosts = 0  # the request's Host header lines
    _host_fault: str | None = None  # why its Host is refused (`_check_host`)

    if TYPE_CHECKING:  # the layers above provide these (`GuardedHttpTools`'s bases)
        def _arm(self, delay: float, callback: object) -> None: ...
        def _disarm(self) -> None: ...
        def _header_timeout(self) -> None: ...
        def _body_timeout(self) -> None: ...
        def _refuse(self, status: int, message: str) -> None: ...
        def _refuse_http2(self) -> None: ...

    def _refuse_unparsed(self, error: httptools.HttpParserError, data: bytes) -> None:
        """Answer bytes the parser refused (`data`: the read it failed in)."""
        if self._origin is None:  # the parser hands a header over only once it ended
            self._origin = _scan_origin(data)
        if self._opening is not None:  # the parser stopped at HTTP/2's preface
            self._refuse_http2()
        elif self._version is not None:
            self._refuse(505, f"HTTP/{self._version} is not supported: kvgate serves "
                              "HTTP/1.1 (and HTTP/1.0).")
        elif self._host_fault is not None:
            self._refuse(400, f"The request is not valid HTTP/1.1: {self._host_fault}.")
        elif self._coding_fault is not None:
            self._refuse(*self._coding_fault)
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
        if len(name) == 4 and name.lower() == b"host":
            self._hosts += 1
            # (RFC 9112 5: optional whitespace around a field value is no part of it; the
            # parser leaves trailing blanks on: "Host: a.example " was refused)
            if _HOST.fullmatch(value.strip(b" \t")) is None:
                self._host_fault = "the Host header is not a host name or address (with a port)"
        if len(name) == 14 and name.lower() == b"content-length" and value.strip().isdigit():
            self._length = int(value)
        if len(name) == 17 and name.lower() == b"transfer-encoding":
            # (several lines are one list, RFC 9110 5.3; judged once the head is whole)
            codings = self._codings if self._codings is not None else []
            codings += (coding.strip(b" \t").lower() for coding in value.split(b","))
            self._codings = codings
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.parser.get_http_version() not in _VERSIONS:
            # `HTTP/2.0` or `HTTP/0.9` on a request line: read as HTTP/1.x and answered, a
            # front proxy reading it otherwise would disagree on where requests end
            self._version = self.parser.get_http_version()
            raise _StopParsing  # refused as a 505 (`data_received`), before any app runs
        self._check_host()
        if self._codings is not None:
            self._coding_fault = _framing_fault(self._codings, self.parser.get_http_version())
            if self._coding_fault is not None:
                raise _StopParsing  # refused (`data_received`), before any app runs
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
        self._origin = self._codings = self._coding_fault = self._host_fault = None
        self._length = None
        self._hosts = 0
        super().on_message_complete()

    def _check_host(self) -> None:
        """RFC 9112 3.2: a 400 for an HTTP/1.1 request without ``Host``, for any request with
        more than one, or with a value that is no host. Served before, two Host lines are
        a request a front proxy and kvgate may read as for two different hosts (a proxy's
        routing or access rules checked one, kvgate's logs name none); every HTTP/1.1 client
        (curl, the SDKs, Kubernetes probes, Prometheus) sends one, HTTP/1.0 ones may not."""
        if self._hosts > 1:
            self._host_fault = "Host is given more than once"
        elif not self._hosts and self.parser.get_http_version() == "1.1":
            self._host_fault = "an HTTP/1.1 request must carry a Host header"
        if self._host_fault is not None:
            raise _StopParsing  # refused as a 400 (`data_received`), before any app runs


def _framing_fault(codings: list[bytes], version: str) -> tuple[int, str] | None:
    """Why a request's ``Transfer-Encoding`` list (lower-cased, every line's) is refused, as
    (status, message); None for ``chunked`` alone. Anything else is refused before its body
    is read and the connection closed (request smuggling: a proxy in front that reads the
    framing otherwise -- ``identity`` as no coding, the first line only, a coding list
    ending otherwise -- would see another request where kvgate sees a body):

    - 400 (RFC 9112 6.3: a request whose final coding is not chunked) for a list not ending
      in one ``chunked``, chunked twice, an empty or unknown coding, ``identity`` (no coding
      since RFC 7230), or any Transfer-Encoding in an HTTP/1.0 request (RFC 9112 6.1: its
      framing is faulty);
    - 501 (RFC 9112 6.1: a coding not implemented) for compressions before one ``chunked``
      (``gzip, chunked``): the body's end is clear, but the parser undoes chunked only, and
      the app would read the compressed bytes as JSON."""
    if codings == [b"chunked"] and version != "1.0":
        return None
    shown = b", ".join(codings).decode("latin-1")[:80]
    if version == "1.0":
        reason = "an HTTP/1.0 request cannot carry Transfer-Encoding; send a Content-Length"
    elif codings[-1] != b"chunked":
        reason = f"Transfer-Encoding {shown!r} does not end in chunked"
    elif codings.count(b"chunked") > 1:
        reason = "Transfer-Encoding names chunked more than once"
    elif all(coding in _COMPRESSIONS for coding in codings[:-1]):
        return 501, (f"Transfer-Encoding {codings[0].decode('latin-1')!r} is not supported "
                     "(only chunked); send the body uncompressed.")
    else:
        reason = f"Transfer-Encoding {shown!r} is not supported: send chunked alone"
    return 400, f"The request is not valid HTTP/1.1: {reason}."


def _scan_origin(data: bytes) -> bytes | None:
    """The value of an ``Origin:`` header line in `data` (bytes that failed to parse)."""
    start = data.lower().find(b"\norigin:")
    if start < 0:
        return None
    end = data.find(b"\n", start + 1)
    value = data[start + 8: end if end >= 0 else len(data)].strip()
    return value or None
