"""Two gateways on one Redis started with different salt secrets say so: each gives a tenant
another cache_salt (and routing key), splitting its cache, and nothing told the operator
(both /readyz answered ready and not degraded, no log line). Neither secret, nor a salt, is
in what they say."""

from __future__ import annotations

from typing import Any

import httpx

from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import Proc, sim_proc

ADMIN = "salt-mismatch-admin-token-0123456789"
OTHER_SECRET = "another-salt-secret-fedcba9876543210"


def _tenancy(base: str) -> dict[str, Any]:
    ready: dict[str, Any] = httpx.get(f"{base}/readyz", timeout=10).json()["tenancy"]
    return ready


def _gateway(url: str, redis_url: str, secret: str) -> tuple[Proc, str]:
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"default": "p"}}}
    return gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": secret, "KVGATE_ADMIN_TOKEN": ADMIN, "KVGATE_REDIS_URL": redis_url})


def test_gateways_with_different_salt_secrets_are_degraded(
        redis_url: str, procs: list[Proc]) -> None:
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    procs.append(sim.start())
    first, a = _gateway(url, redis_url, AUTH_SECRET)
    procs.append(first.start())
    same, b = _gateway(url, redis_url, AUTH_SECRET)
    procs.append(same.start())
    # one secret: nothing to say
    assert _tenancy(a)["degraded"] is False and _tenancy(b)["degraded"] is False
    other, c = _gateway(url, redis_url, OTHER_SECRET)
    procs.append(other.start())

    def says(base: str) -> bool:
        return "other salt secret" in (_tenancy(base)["reason"] or "")

    for base in (a, b, c):
        wait_for(lambda base=base: says(base), timeout=60, what=f"{base} degraded")  # type: ignore[misc]
        assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200  # still serving
    said = "".join(httpx.get(f"{base}/readyz", timeout=10).text for base in (a, b, c))
    logs = "".join(p.output(tail=None) for p in (first, same, other))
    assert "different secrets" in logs
    for secret in (AUTH_SECRET, OTHER_SECRET):
        assert secret not in said and secret not in logs
