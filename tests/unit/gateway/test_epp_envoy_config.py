"""The Envoy bootstrap's circuit breakers and retries (`gateway.epp.envoy.envoy_config`): set,
never Envoy's defaults (1,024 requests per cluster, 3 retries at once), from `max_requests`
and kvgate's `upstream` retry settings. That Envoy enforces them: the integration test
tests/integration/test_epp_circuit_breaker.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config import UpstreamConfig
from gateway.epp.envoy import MAX_REQUESTS, envoy_config

ENDPOINTS = ["10.0.0.1:8000", "10.0.0.2:8000"]


def _render(**options: Any) -> dict[str, Any]:
    return envoy_config(listen_port=8081, picker="127.0.0.1:9002", **options)


def _breakers(config: dict[str, Any], cluster: str) -> dict[str, Any]:
    (found,) = [c for c in config["static_resources"]["clusters"] if c["name"] == cluster]
    (thresholds,) = found["circuit_breakers"]["thresholds"]
    return dict(thresholds)


def _retries(config: dict[str, Any]) -> list[dict[str, Any]]:
    (listener,) = config["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    return [r["route"]["retry_policy"] for r in routes]


@pytest.mark.parametrize("endpoints", [None, ENDPOINTS])
@pytest.mark.parametrize(("options", "replicas", "picker", "budget"), [
    ({}, MAX_REQUESTS, 3 * MAX_REQUESTS, (20.0, 10)),
    ({"max_requests": 2}, 2, 6, (20.0, 10)),
    ({"upstream": UpstreamConfig(retry_budget_ratio=0.05, retry_budget_min=0)},
     MAX_REQUESTS, 3 * MAX_REQUESTS, (5.0, 0)),
    ({"max_requests": 250_000, "upstream": UpstreamConfig(retry_budget_ratio=1)},
     250_000, 750_000, (100.0, 10)),
])
def test_both_clusters_carry_the_limits(
    endpoints: list[str] | None, options: dict[str, Any], replicas: int, picker: int,
    budget: tuple[float, int],
) -> None:
    config = _render(endpoints=endpoints, **options)
    percent, floor = budget
    assert _breakers(config, "kvgate_pool") == {
        "max_connections": replicas, "max_pending_requests": replicas, "max_requests": replicas,
        "retry_budget": {"budget_percent": {"value": percent}, "min_retry_concurrency": floor}}
    assert _breakers(config, "kvgate_epp") == {
        "max_connections": picker, "max_pending_requests": picker, "max_requests": picker}


@pytest.mark.parametrize(("upstream", "retries", "statuses"), [
    (UpstreamConfig(), 2, [500, 502, 503, 504]),
    (UpstreamConfig(max_attempts=1), 0, [500, 502, 503, 504]),
    (UpstreamConfig(max_attempts=5, retry_statuses=[503]), 4, [503]),
])
def test_failover_retries_are_upstreams(
    upstream: UpstreamConfig, retries: int, statuses: list[int],
) -> None:
    for policy in _retries(_render(endpoints=ENDPOINTS, upstream=upstream)):
        assert policy["num_retries"] == retries
        assert policy["retriable_status_codes"] == statuses
    # one endpoint (ORIGINAL_DST): nothing to fail over to
    assert all(p["num_retries"] == 0 for p in _retries(_render(upstream=upstream)))


@pytest.mark.parametrize("limit", [0, -1, 1431655766])
def test_a_limit_envoy_cannot_take_is_refused(limit: int) -> None:
    with pytest.raises(ValueError, match="max_requests must be from 1 to 1431655765"):
        _render(max_requests=limit)


def test_the_largest_limit_fits_envoys_thresholds() -> None:
    assert _breakers(_render(max_requests=1431655765), "kvgate_epp")["max_requests"] == 2**32 - 1
