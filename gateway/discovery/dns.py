"""Resolve a (headless) Service name periodically: every address is one replica.

For clusters where kvgate may not read the Kubernetes API. A headless Service's DNS name
resolves to the ready pods' addresses (Kubernetes DNS spec); we poll, since DNS has no watch.
A failed lookup keeps the last set: a resolver hiccup must not empty a working pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

from gateway.discovery.base import OnChange, WatcherBase, format_url
from gateway.discovery.config import DnsConfig

__all__ = ["DnsDiscovery", "Resolver", "one_family", "resolve_addresses"]

log = logging.getLogger(__name__)

# (host, port) -> the addresses it resolves to. The default is the loop's getaddrinfo;
# tests may pass another to script changes that a real resolver cannot produce on demand.
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_addresses(host: str, port: int) -> list[str]:
    """Addresses for ``host`` via the event loop's non-blocking getaddrinfo."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def one_family(addresses: list[str]) -> list[str]:
    """The IPv4 addresses when there are IPv4 and IPv6 ones: a dual-stack Service's name
    resolves to each pod's address of both families, and each pod was two replicas (its
    load and prefix affinity split in two; vLLM listens on IPv4 unless told otherwise)."""
    v4 = [a for a in addresses if _version(a) == 4]
    return v4 if v4 and any(_version(a) == 6 for a in addresses) else addresses


def _version(address: str) -> int | None:
    try:
        return ipaddress.ip_address(address.partition("%")[0]).version  # (an IPv6 zone)
    except ValueError:
        return None


class DnsDiscovery(WatcherBase):
    def __init__(
        self,
        pool: str,
        config: DnsConfig,
        on_change: OnChange,
        *,
        resolver: Resolver = resolve_addresses,
    ) -> None:
        super().__init__(pool, on_change)
        self.config = config
        self._resolve = resolver

    async def _run(self) -> None:
        cfg = self.config
        while True:
            try:
                addresses = await self._resolve(cfg.name, cfg.port)
            # socket.gaierror is an OSError; a name the IDNA codec refuses (a label over 63
            # characters) raises UnicodeError before any lookup: it ended this task unsaid
            except (OSError, UnicodeError) as exc:
                log.warning(
                    "dns discovery failed; keeping the last set",
                    extra={"pool": self.pool, "error": str(exc)[:200]},
                )
            else:
                self._publish(frozenset(format_url(cfg.scheme, a, cfg.port)
                                        for a in one_family(addresses)))
            await asyncio.sleep(cfg.interval_seconds)
