"""Replicas listed at the address the gateway itself listens on.

A replica URL naming the gateway's own port on this machine (`--upstream
http://127.0.0.1:8000` beside `--port 8000`, a copied port in a config file) made every request
come back to the gateway, which sent it on to itself again, each hop holding a connection,
until the client gave up; its health checks passed meanwhile (kvgate answers vLLM's /health).
The same address beside `kvgate epp`'s gRPC port had the picker's health checks and picks
aimed at the picker. Such a replica is refused when the process starts, naming it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from urllib.parse import urlsplit

from gateway.config.model import KvgateConfig
from gateway.urls import shown_url

__all__ = ["EPP_HTTP_PORT", "epp_ports", "own_address_replicas", "serve_ports"]

EPP_HTTP_PORT = 9090  # `kvgate epp`'s HTTP port when server.admin_port is unset
_ANY = ("0.0.0.0", "::", "")  # a listener on every address: loopback included


def serve_ports(cfg: KvgateConfig) -> dict[int, str]:
    """The ports `kvgate serve` listens on, by the setting that names them (0: any free
    port, which no replica URL can name beforehand)."""
    ports = {cfg.server.port: "server.port"}
    if cfg.server.admin_port is not None:
        ports[cfg.server.admin_port] = "server.admin_port"
    return {port: name for port, name in ports.items() if port}


def epp_ports(cfg: KvgateConfig) -> dict[int, str]:
    """The ports `kvgate epp` listens on: its gRPC port and its HTTP one."""
    ports = {cfg.server.admin_port or EPP_HTTP_PORT: "server.admin_port", cfg.epp.port: "epp.port"}
    return {port: name for port, name in ports.items() if port}


def own_address_replicas(cfg: KvgateConfig, ports: Mapping[int, str]) -> list[str]:
    """One line per listed replica whose address is one of `ports` on this gateway's listen
    address (discovered replicas are not known yet)."""
    out = []
    for name, pool in cfg.pools.items():
        for url in pool.replicas:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            if port in ports and _is_own_host(parts.hostname or "", cfg.server.host):
                out.append(f"pools.{name}: the replica {shown_url(url)} is this gateway's own "
                           f"address ({ports[port]} {port}): its requests would come back to "
                           "kvgate; list the vLLM server's address, or listen on another port")
    return out


def _is_own_host(host: str, listen_host: str) -> bool:
    if host.lower() == listen_host.lower():
        return True
    listens_locally = listen_host in _ANY or _is_loopback(listen_host)
    return listens_locally and (host in _ANY or _is_loopback(host))


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False
