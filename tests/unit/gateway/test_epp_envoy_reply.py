"""Who made an answer Envoy shows the picker (gateway/epp/envoy_reply.py): Envoy's response code
details when it sends them, else its router's plain-text bodies."""

from __future__ import annotations

import pytest

from gateway.epp import wire
from gateway.epp.envoy_reply import local, maker

CONNECT = (b"upstream connect error or disconnect/reset before headers. reset reason: remote "
           b"connection failure, transport failure reason: delayed connect error: 111")


@pytest.mark.parametrize(("details", "status", "body", "expected"), [
    ("via_upstream", 503, CONNECT, "replica"),  # a replica's answer, whatever its text
    ("via_upstream", 403, b"", "replica"),
    ("local_rate_limited", 429, b"local_rate_limited", "local"),
    ("no_healthy_upstream", 503, b"no healthy upstream", "local"),
    ("rbac_access_denied_matched_policy[blocked]", 403, b"RBAC: access denied", "local"),
    ("upstream_per_try_idle_timeout", 504, wire.ROUTER_TIMEOUT, "timeout"),
    ("upstream_response_timeout", 504, b"", "timeout"),
    ("upstream_reset_before_response_started{remote_connection_failure|delayed_connect_"
     "error:_Connection_refused}", 503, b"", "connect"),
    ("upstream_reset_before_response_started{overflow}", 503, b"", "overflow"),
    ("upstream_reset_before_response_started{connection_termination}", 503, b"", "reset"),
    # no details (a data plane that does not send them): the router's bodies
    (None, 504, wire.ROUTER_TIMEOUT, "timeout"),
    (None, 503, CONNECT, "connect"),
    (None, 503, wire.ROUTER_RESET + b" reset reason: overflow", "overflow"),
    (None, 503, wire.ROUTER_RESET + b" reset reason: connection termination", "reset"),
    (None, 503, b"no healthy upstream", "replica"),  # cannot be told: as before
    (None, 429, b"local_rate_limited", "replica"),
])
def test_maker(details: str | None, status: int, body: bytes, expected: str) -> None:
    assert maker(details, status, body) == expected
    assert local(details) is (expected == "local")
