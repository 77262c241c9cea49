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
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from gateway.config.model import KvgateConfig
from gateway.urls import shown_url

__all__ = ["EPP_HTTP_PORT", "epp_ports", "own_address_lines", "own_address_replicas",
           "running_ports", "serve_ports"]

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


def running_ports(cfg: KvgateConfig) -> dict[int, str]:
    """The ports of the running process, from its configuration: `kvgate epp` runs with
    `server.port` 0 (it has no API port), `kvgate serve` with the port it bound (its 0
    replaced by then)."""
    return epp_ports(cfg) if cfg.server.port == 0 else serve_ports(cfg)


def own_address_replicas(cfg: KvgateConfig, ports: Mapping[int, str]) -> list[str]:
    """One line per listed replica whose address is one of `ports` on this gateway's listen
    address (discovered replicas are not known yet)."""
    pools = {name: pool.replicas for name, pool in cfg.pools.items()}
    return own_address_lines(pools, cfg.server.host, ports)


def own_address_lines(
    pools: Mapping[str, Sequence[str]], listen_host: str, ports: Mapping[int, str]
) -> list[str]:
    """`own_address_replicas` of replica URLs by pool (a policy document's too: the admin
    API checks a write with it). It may resolve names, for up to `_RESOLVE_S`: blocking."""
    listed = [(name, url, urlsplit(url)) for name, replicas in pools.items()
              for url in replicas]
    on_ports = [(name, url, parts, port) for name, url, parts in listed
                if (port := parts.port or (443 if parts.scheme == "https" else 80)) in ports]
    if not on_ports:
        return []
    found = _resolved({parts.hostname or "" for _, _, parts, _ in on_ports} | {listen_host})
    out = []
    for name, url, parts, port in on_ports:
        host = parts.hostname or ""
        if _is_own_host(host, found.get(host, set()), listen_host, found.get(listen_host, set())):
            out.append(f"pools.{name}: the replica {shown_url(url)} is this gateway's own "
                       f"address ({ports[port]} {port}): its requests would come back to "
                       "kvgate; list the vLLM server's address, or listen on another port")
    return out


_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_RESOLVE_S = 2.0  # a replica name's look-up at start waits this long at most (a slow DNS)
_NOT_LOCAL = "203.0.113.254"  # TEST-NET-3: bindable only where any address is (ip_nonlocal_bind)


def _is_own_host(host: str, targets: set[_Address], listen_host: str,
                 listens_on: set[_Address]) -> bool:
    """Whether a connection to `host` (resolved: `targets`) reaches a listener on
    `listen_host` (resolved: `listens_on`) on this machine. Compared as the HTTP client
    connects, not as written: ``127.1``, ``2130706433``, ``::ffff:127.0.0.1``, this machine's
    host name or one of its addresses name the gateway as ``127.0.0.1`` does."""
    if host.lower() == listen_host.lower():
        return True
    if _is_loopback_name(host):
        targets = targets | {ipaddress.ip_address("127.0.0.1")}
    # a connection to 0.0.0.0 or :: goes to this machine's loopback
    targets = {ipaddress.ip_address("127.0.0.1") if a.is_unspecified else a for a in targets}
    if listen_host in _ANY:  # every address of this machine
        return any(a.is_loopback or _is_local(a) for a in targets)
    if _is_loopback_name(listen_host) or any(a.is_loopback for a in listens_on):
        return any(a.is_loopback for a in targets)
    return bool(targets & listens_on)


def _is_loopback_name(host: str) -> bool:
    # (RFC 6761: localhost, with or without its final dot, is always loopback)
    return host.lower().rstrip(".") == "localhost"


def _resolved(hosts: set[str]) -> dict[str, set[_Address]]:
    """The addresses each of `hosts` resolves to (IPv4-mapped IPv6 ones as IPv4), looked
    up at once in daemon threads; one that does not resolve within `_RESOLVE_S` (or at
    all) has none: a replica not reached yet is no loop found."""
    found: dict[str, set[_Address]] = {}

    def look_up(host: str) -> None:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return
        found[host] = {_unmapped(str(info[4][0]).partition("%")[0]) for info in infos}

    threads = [threading.Thread(target=look_up, args=(h,), daemon=True) for h in hosts if h]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + _RESOLVE_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return dict(found)


def _unmapped(text: str) -> _Address:
    address = ipaddress.ip_address(text)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_local(address: _Address) -> bool:
    """Whether `address` is one of this machine's: it can be bound to (port 0: nothing is
    taken). Where the kernel lets any address be bound (ip_nonlocal_bind), none is judged
    so, lest every replica on the gateway's port be refused."""
    return _bindable(address) and not _bindable(ipaddress.ip_address(_NOT_LOCAL))


def _bindable(address: _Address) -> bool:
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((str(address), 0))
    except OSError:
        return False
    return True
