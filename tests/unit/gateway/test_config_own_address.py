"""A replica listed at the gateway's own listening address is found before the process
starts: `kvgate serve --port 8000 --upstream http://127.0.0.1:8000` sent every request back to
the gateway, hop after hop, until the client gave up (its /health passed: kvgate answers
vLLM's). And examples/kvgate.yaml listed an fp8 replica at 127.0.0.1:9002, `epp.port`'s
default: `kvgate epp --config` on the example aimed the picker's checks and picks at itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.config import (
    epp_ports,
    load_config,
    own_address_replicas,
    serve_ports,
)

ROOT = Path(__file__).resolve().parents[3]


def config(replica: str, **server: Any) -> Any:
    return load_config(None, environ={}, overrides={
        "server": {"port": 8000, **server},
        "pools": {"p": {"served_model": "m", "replicas": [replica]}}})


@pytest.mark.parametrize("replica", [
    "http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000",
    "http://127.0.0.2:8000", "http://0.0.0.0:8000", "http://user:secret@127.0.0.1:8000",
])
def test_a_loopback_replica_on_the_gateway_port_is_named(replica: str) -> None:
    cfg = config(replica)
    (line,) = own_address_replicas(cfg, serve_ports(cfg))
    assert line.startswith("pools.p: the replica http://")
    assert "(server.port 8000)" in line
    assert "secret" not in line  # credentials are never shown


@pytest.mark.parametrize(("replica", "server"), [
    ("http://127.0.0.1:8001", {}),                    # another port
    ("http://10.0.0.5:8000", {}),                     # another machine
    ("http://127.0.0.1:8000", {"host": "10.0.0.9"}),  # the gateway is not on loopback
    ("http://127.0.0.1:8000", {"port": 0}),           # a free port, chosen at start
])
def test_other_addresses_are_not_the_gateway(replica: str, server: dict[str, Any]) -> None:
    cfg = config(replica, **server)
    assert own_address_replicas(cfg, serve_ports(cfg)) == []


def test_the_admin_port_and_the_listen_host_count() -> None:
    cfg = config("http://10.0.0.9:8001", host="10.0.0.9", admin_port=8001)
    (line,) = own_address_replicas(cfg, serve_ports(cfg))
    assert "(server.admin_port 8001)" in line


def test_the_pickers_ports_are_its_grpc_and_http_ones() -> None:
    cfg = config("http://127.0.0.1:9002")
    assert own_address_replicas(cfg, serve_ports(cfg)) == []
    (line,) = own_address_replicas(cfg, epp_ports(cfg))
    assert "(epp.port 9002)" in line
    assert own_address_replicas(config("http://127.0.0.1:9090"), epp_ports(cfg))


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_no_example_lists_a_replica_at_its_own_ports(path: Path) -> None:
    """An example is copied as it is (README: `cp examples/kvgate.yaml kvgate.yaml`) and run
    with `kvgate serve` and `kvgate epp` alike."""
    cfg = load_config(str(path), environ={})
    assert own_address_replicas(cfg, {**serve_ports(cfg), **epp_ports(cfg)}) == []
