"""Replica discovery for pools: Kubernetes EndpointSlices (list + watch) or periodic DNS.

Usage (owned by the app's lifespan)::

    source = build_discovery("fp8", pool_config.discovery, on_change)
    await source.start()          # background task on the running loop
    ...                           # on_change("fp8", frozenset({"http://10.0.0.7:8000", ...}))
    await source.stop()           # cancels and awaits the task, closes its HTTP client
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.discovery.base import OnChange, WatcherBase
from gateway.discovery.config import (
    DiscoveryConfigError,
    DnsConfig,
    KubernetesConfig,
    parse_discovery,
)
from gateway.discovery.dns import DnsDiscovery, Resolver, resolve_addresses
from gateway.discovery.kubernetes import KubeApiError, KubernetesDiscovery
from gateway.discovery.manager import DiscoveryManager

__all__ = [
    "DiscoveryConfigError",
    "DiscoveryManager",
    "DiscoverySource",
    "DnsConfig",
    "DnsDiscovery",
    "KubeApiError",
    "KubernetesConfig",
    "KubernetesDiscovery",
    "OnChange",
    "Resolver",
    "build_discovery",
    "parse_discovery",
    "resolve_addresses",
]

DiscoverySource = WatcherBase


def build_discovery(
    pool: str,
    raw: dict[str, dict[str, object]],
    on_change: OnChange,
    *,
    env: Mapping[str, str] | None = None,
) -> DiscoverySource:
    """The discovery source a pool's ``discovery`` mapping names (not started yet).

    Raises ``DiscoveryConfigError`` (naming the field) for a bad mapping, or when Kubernetes
    mode has no ``api_server`` and no in-cluster environment.
    """
    config = parse_discovery(raw)
    if isinstance(config, KubernetesConfig):
        return KubernetesDiscovery(pool, config, on_change, env=env)
    return DnsDiscovery(pool, config, on_change)
