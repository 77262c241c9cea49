"""Which of a replica's response headers reach the client, at both edges.

A replica's answer (or a proxy's, a sidecar's in front of it) may carry headers that describe
the answer end to end -- ``cache-control``, ``vary``, ``content-language``, a sidecar's own
``x-*`` --: they pass, as a client calling the replica directly gets them (the HTTP edge
dropped them all; Envoy passed them on, so the two edges disagreed). Not passed:

- hop-by-hop headers (RFC 9110 7.6.1: ``connection`` and the names it lists,
  ``keep-alive``, ``transfer-encoding``, ``te``, ``trailer``, ``upgrade``,
  ``proxy-connection``, ``proxy-authenticate``): they are about the replica's connection,
  not kvgate's with the client (Envoy drops them itself);
- what kvgate sets for the answer it sends: its framing and media type (``content-length``,
  ``content-type``, ``content-encoding``), ``x-request-id`` (the client's or kvgate's, as on
  every answer), ``retry-after`` (`verdicts.relayed_retry_after`), ``date`` and ``server``,
  what describes the replica's bytes, which kvgate may change (``etag``, the digests), or
  requests it does not pass on (``accept-ranges``, ``content-range``),
  the ``x-kvgate-*`` headers, the tenant's ``x-ratelimit-*`` (a replica's or a proxy's would
  read to the SDK as kvgate's limits) and CORS (``access-control-*``, `server.cors_*`);
- what belongs to the replica's origin, not kvgate's: ``set-cookie`` (an internal load
  balancer's stickiness cookie), ``alt-svc``, ``strict-transport-security``, and the URLs of
  ``location``, ``content-location`` and ``link`` (an internal address: a sidecar's
  ``link: <http://10.0.0.3:8000/...>; rel=preload``; vLLM sends none, and a 103's links are
  dropped with it);
- what names the path the answer took inside (``via``, ``forwarded``, ``x-forwarded-*``: a
  proxy or a sidecar in front of the replica writes its internal host names and addresses
  there, as ``via: 1.1 vllm-3.llm.svc.cluster.local``; both edges passed them on).

The HTTP edge keeps the headers that pass (`H1Conn` reads them as they come) for proxied and
stored answers; the endpoint picker has Envoy remove the others it would pass (`removed`:
Envoy drops the hop-by-hop ones, not the names ``connection`` lists, and sets the framing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["NO_RETRY", "no_retry", "passes", "removed", "without_listed"]

# kvgate's hint on an answer retrying cannot help: the official SDKs read x-should-retry before
# their status rules (which retry 408, 409, 429 and every 5xx)
NO_RETRY = (b"x-should-retry", b"false")

_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                         b"transfer-encoding", b"upgrade", b"proxy-authenticate"})
_FRAMING = frozenset({b"content-length", b"content-type", b"content-encoding", b"date",
                      b"server"})
# what describes the replica's bytes, which kvgate may change (an error re-shaped, the usage
# chunk dropped, a byte order mark left out), or a request kvgate does not pass on (a range, a
# validator): not kvgate's answer's
_BYTES = frozenset({b"etag", b"content-md5", b"digest", b"content-digest", b"repr-digest",
                    b"accept-ranges", b"content-range"})
_KVGATES = frozenset({b"x-request-id", b"retry-after"})
_ORIGINS = frozenset({b"set-cookie", b"alt-svc", b"strict-transport-security", b"location",
                      b"content-location", b"link"})
# the path inside: internal host names and addresses
_INSIDE = frozenset({b"via", b"forwarded"})
_INSIDE_PREFIX = b"x-forwarded-"
_KVGATES_PREFIXES = (b"x-kvgate-", b"x-ratelimit-", b"access-control-")
_NOT_PASSED = _HOP_BY_HOP | _FRAMING | _BYTES | _KVGATES | _ORIGINS | _INSIDE
_PREFIXES = (*_KVGATES_PREFIXES, _INSIDE_PREFIX)


def passes(name: bytes) -> bool:
    """Whether a response header of this (lower-case) name reaches the client."""
    return name not in _NOT_PASSED and not name.startswith(_PREFIXES)


def without_listed(
    headers: list[tuple[bytes, bytes]], connection: bytes,
) -> list[tuple[bytes, bytes]]:
    """`headers` without those the ``Connection`` header's value (`connection`) names: hop
    by hop too (RFC 9110 7.6.1)."""
    listed = {t.strip().lower() for t in connection.split(b",")}
    return [(k, v) for k, v in headers if k not in listed]


def removed(names: Iterable[str], connection: str | None = None) -> list[str]:
    """Of a replica's response header names (lower case, as Envoy gives them), those the
    picker has Envoy remove: the replica's origin's, its bytes', the path's inside and the
    ``x-kvgate-*``/``x-ratelimit-*`` ones, which Envoy would pass and the HTTP edge does not,
    and those its ``Connection`` header's value (`connection`) names: Envoy drops that header
    and the hop-by-hop ones, but passed the names it lists on (``Connection: close,
    x-private``). The others kvgate sets are overwritten (``x-request-id``) or are Envoy's to
    set (the framing); CORS is Envoy's own filter's there."""
    listed = set() if connection is None else {
        t.strip().lower() for t in connection.split(",")}
    out = []
    for name in names:
        raw = name.encode("latin-1")
        if raw in _ORIGINS or raw in _BYTES or raw in _INSIDE or (
                raw.startswith(_PREFIXES) and not raw.startswith(b"access-control-")) or (
                name in listed and not name.startswith(":") and raw not in _HOP_BY_HOP
                and raw not in _FRAMING and raw not in _KVGATES):
            out.append(name)
    return out


def no_retry(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`headers` (a replica's passed ones) saying `NO_RETRY`, the replica's own hint left out
    (two values would read to the SDK as neither, and it would retry)."""
    return [*((k, v) for k, v in headers if k.lower() != NO_RETRY[0]), NO_RETRY]
