"""Which of a replica's response headers reach the client (`gateway.answer_headers`)."""

from __future__ import annotations

import pytest

from gateway.answer_headers import passes, removed, without_listed


@pytest.mark.parametrize("name", [b"cache-control", b"vary", b"content-language", b"x-sidecar",
                                  b"openai-processing-ms", b"x-should-retry"])
def test_end_to_end_headers_pass(name: bytes) -> None:
    assert passes(name)


@pytest.mark.parametrize("name", [
    # hop by hop (RFC 9110 7.6.1)
    b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
    b"upgrade", b"proxy-authenticate",
    # kvgate's own
    b"content-length", b"content-type", b"content-encoding", b"date", b"server",
    b"x-request-id", b"retry-after", b"x-kvgate-replica", b"x-ratelimit-remaining-tokens",
    b"access-control-allow-origin",
    # the replica's bytes (kvgate may change them), requests it does not pass on
    b"etag", b"content-digest", b"repr-digest", b"digest", b"content-md5", b"accept-ranges",
    b"content-range",
    # the replica origin's
    b"set-cookie", b"alt-svc", b"strict-transport-security", b"location", b"content-location",
    b"link",
    # the path inside (internal host names and addresses)
    b"via", b"forwarded", b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto",
])
def test_hop_by_hop_own_and_origin_headers_do_not(name: bytes) -> None:
    assert not passes(name)


def test_the_names_the_connection_header_lists_are_hop_by_hop() -> None:
    headers = [(b"x-hop", b"1"), (b"x-end", b"2"), (b"x-other", b"3")]
    assert without_listed(headers, b",keep-alive, X-Hop ,x-other") == [(b"x-end", b"2")]


def test_the_picker_removes_what_envoy_would_pass_and_the_http_edge_does_not() -> None:
    names = [":status", "content-type", "cache-control", "set-cookie", "x-ratelimit-limit-tokens",
             "x-kvgate-route", "access-control-allow-origin", "location", "x-request-id",
             "etag", "via", "x-forwarded-for", "forwarded"]
    assert removed(names) == ["set-cookie", "x-ratelimit-limit-tokens", "x-kvgate-route",
                              "location", "etag", "via", "x-forwarded-for", "forwarded"]


def test_the_picker_removes_the_names_the_connection_header_lists() -> None:
    """Envoy drops ``connection`` but passed the names it lists; never one kvgate or Envoy
    sets (the framing, ``x-request-id``) nor a pseudo-header."""
    names = [":status", "content-type", "connection", "x-private", "x-hop", "x-end",
             "x-request-id", "keep-alive"]
    assert removed(names, "close, X-Private ,x-hop,content-type,x-request-id,:status") == [
        "x-private", "x-hop"]
    assert removed(names) == []
