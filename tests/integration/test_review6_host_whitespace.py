"""RFC 9112 5: whitespace around a field value is no part of it, so a ``Host`` with blanks
after the name (some hand-written clients and proxies send them) names a host: served. Before,
the Host check (`gateway.head_checks`) read the parser's value with its trailing blanks and
refused it with a 400. The hosts platform clients send are served too (kubelet's probe and
Prometheus's scrape name an address and port, Envoy its :authority, a zone id in an IPv6
literal, a fully qualified name with its dot); raw UTF-8 stays refused, as by Go's net/http.
Real `kvgate serve` in front of a simulated replica, raw sockets as the client."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.integration.test_http5_host_header import _chat
from tests.support.gateway import gateway_proc
from tests.support.procs import sim_proc
from tests.support.raw_http import exchange

MODEL = "sim-model"


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    sim, sim_url = sim_proc(None, "--time-scale", "50", model=MODEL)
    with sim:
        gw, base = gateway_proc(upstreams=[sim_url])
        with gw:
            yield int(base.rsplit(":", 1)[1])


@pytest.mark.parametrize("host", [
    b"Host: api.example.com \r\n", b"Host: 10.0.0.5:8000\t\r\n", b"Host:  localhost  \r\n",
    b"Host: 10.0.0.5:9090\r\n", b"Host: [fe80::1%25eth0]:8000\r\n", b"Host: example.com.\r\n",
    b"Host: EXAMPLE.COM\r\n", b"Host: xn--bcher-kva.example\r\n",
], ids=["trailing-space", "trailing-tab", "both-sides", "prometheus", "ipv6-zone", "fqdn-dot",
        "uppercase", "punycode"])
def test_hosts_clients_send_are_served(port: int, host: bytes) -> None:
    [(status, body)] = exchange(port, _chat(host))
    assert status == 200, body


def test_raw_utf8_and_inner_blanks_stay_refused(port: int) -> None:
    for host in ("Host: bücher.example\r\n".encode(), b"Host: a b\r\n"):
        [(status, body)] = exchange(port, _chat(host))
        assert status == 400 and "not a host name" in json.loads(body)["error"]["message"]
