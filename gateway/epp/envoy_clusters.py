"""The clusters of kvgate's Envoy bootstrap (`gateway/epp/envoy.py`): the replicas' (any
address from the picker's header, or a static list walked on retries) and their circuit
breakers; addresses as Envoy writes them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.config import UpstreamConfig
from gateway.epp.envoy_filters import TYPES
from gateway.epp.wire import DESTINATION, LB_NAMESPACE

__all__ = ["circuit_breakers", "pool_cluster", "socket_address", "split_hostport"]


def socket_address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def split_hostport(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def circuit_breakers(limit: int, up: UpstreamConfig | None = None) -> dict[str, Any]:
    """Circuit breakers at `limit` (connections, requests, pending); with `up`, the retry
    budget of kvgate's HTTP edge: retries at most `retry_budget_ratio` of the requests in
    flight, `retry_budget_min` always (Envoy's own default: 3 retries at once, fleet-wide)."""
    thresholds: dict[str, Any] = {
        "max_connections": limit, "max_pending_requests": limit, "max_requests": limit}
    if up is not None:
        thresholds["retry_budget"] = {
            "budget_percent": {"value": round(100 * up.retry_budget_ratio, 6)},
            "min_retry_concurrency": up.retry_budget_min}
    return {"thresholds": [thresholds]}



def pool_cluster(endpoints: Sequence[str] | None, breakers: dict[str, Any]) -> dict[str, Any]:
    if not endpoints:
        return {
            "name": "kvgate_pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s", "circuit_breakers": breakers,
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    round_robin = {"name": "envoy.load_balancing_policies.round_robin", "typed_config": {
        "@type": f"{TYPES}.load_balancing_policies.round_robin.v3.RoundRobin"}}
    override = {"name": "envoy.load_balancing_policies.override_host", "typed_config": {
        "@type": f"{TYPES}.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [
            {"header": DESTINATION},
            {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}},
        ],
        "fallback_policy": {"policies": [{"typed_extension_config": round_robin}]},
    }}
    lb_endpoints = [{"endpoint": {"address": socket_address(*split_hostport(e))}}
                    for e in endpoints]
    return {
        "name": "kvgate_pool", "type": "STATIC", "connect_timeout": "5s",
        "circuit_breakers": breakers,
        "load_balancing_policy": {"policies": [{"typed_extension_config": override}]},
        "load_assignment": {"cluster_name": "kvgate_pool",
                            "endpoints": [{"lb_endpoints": lb_endpoints}]},
    }

