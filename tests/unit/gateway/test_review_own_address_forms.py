"""A replica URL that names the gateway's own address in another spelling than the one the
check compared: ``127.1``, ``2130706433``, ``0``, ``[::ffff:127.0.0.1]``, ``localhost.``,
this machine's host name, or (listening on every address) one of this machine's own
addresses. The HTTP client connects to each as it does to ``127.0.0.1``, so the gateway sent
each request back to itself while the start-up check let it pass."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from gateway.config import load_config, own_address_replicas, serve_ports


def config(replica: str, host: str) -> Any:
    return load_config(None, environ={}, overrides={
        "server": {"port": 8000, "host": host},
        "pools": {"p": {"served_model": "m", "replicas": [replica]}}})


def own_addresses() -> list[str]:
    """This machine's host name, when it resolves (it does not everywhere)."""
    try:
        socket.getaddrinfo(socket.gethostname(), None)
    except OSError:
        return []
    return [socket.gethostname()]


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
@pytest.mark.parametrize("replica_host", [
    "127.1", "2130706433", "0", "[::ffff:127.0.0.1]", "localhost.", *own_addresses()])
def test_another_spelling_of_the_gateway_is_named(replica_host: str, host: str) -> None:
    cfg = config(f"http://{replica_host}:8000", host)
    (line,) = own_address_replicas(cfg, serve_ports(cfg))
    assert f"the replica http://{replica_host}:8000 is this gateway's own address" in line


def outward_address() -> str:
    """An address of this machine's that is not loopback (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.123", 9))
        except OSError:
            pytest.skip("no route off this machine")
        address = str(sock.getsockname()[0])
    if address.startswith("127."):
        pytest.skip("no address but loopback")
    return address


def test_one_of_this_machines_addresses_is_the_gateway_listening_on_all() -> None:
    address = outward_address()
    cfg = config(f"http://{address}:8000", "0.0.0.0")
    assert len(own_address_replicas(cfg, serve_ports(cfg))) == 1
    # listening on loopback only, that address reaches no gateway
    assert own_address_replicas(config(f"http://{address}:8000", "127.0.0.1"),
                                {8000: "server.port"}) == []


@pytest.mark.parametrize("replica_host", ["name.invalid", "203.0.113.9", "[2001:db8::1]"])
def test_names_that_do_not_resolve_and_other_machines_are_not_the_gateway(
        replica_host: str) -> None:
    cfg = config(f"http://{replica_host}:8000", "0.0.0.0")
    assert own_address_replicas(cfg, serve_ports(cfg)) == []
