"""Two gateways on one Redis started with different salt secrets say so: each gives a tenant
another cache_salt (and routing key), splitting its cache, and nothing told the operator
(both /readyz answered ready and not degraded, no log line). Neither secret, nor a salt, is
in what they say."""

from __future__ import annotations

from typing import Any

import httpx
import redis

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


def test_no_auth_gateways_without_a_secret_send_no_salt_to_compare(
        redis_url: str, procs: list[Proc]) -> None:
    """``--no-auth`` without a secret draws a random one in each process and sends no salt:
    two such gateways on one Redis are not told apart (they read degraded, one secret each)."""
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    procs.append(sim.start())
    bases = []
    for _ in range(2):
        gw, base = gateway_proc(upstreams=[url], env={"KVGATE_REDIS_URL": redis_url})
        procs.append(gw.start())
        bases.append(base)
    # a salted gateway's first check is done before it answers /readyz
    assert redis.Redis.from_url(redis_url).exists("kvgate:salt_secrets") == 0
    for base in bases:
        assert _tenancy(base)["degraded"] is False, _tenancy(base)
