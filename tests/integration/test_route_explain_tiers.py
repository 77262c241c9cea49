"""`POST /admin/route/explain` by tier against a real gateway: the tiers it takes are the ones a
tenant may be in."""

from __future__ import annotations

from collections.abc import Callable

from tests.support.gateway import admin_client, gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "admin-token-0123456789abcdef"


def test_explain_takes_the_default_tier_when_the_policy_lists_only_others(
    sim_factory: SimFactory,
) -> None:
    """A policy whose `tiers` list only `free` still serves tenants of the tier `default`
    (the admin API creates them, the proxy answers them), but route explain for
    ``{"tier": "default"}`` was a 400 "unknown tier"."""
    _, sim = sim_factory("--time-scale", "50")
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}},
              "tiers": {"free": {"limits": {"rpm": 60}}}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN})
    request = {"model": "llama", "prompt": "hello"}
    with gw, admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "acme", "tier": "default"}).status_code == 201
        by_tenant = admin.post("/route/explain", json={"tenant": "acme", "request": request})
        assert by_tenant.status_code == 200, by_tenant.text
        for tier in ("default", "free"):
            r = admin.post("/route/explain", json={"tier": tier, "request": request})
            assert r.status_code == 200, (tier, r.text)
            assert r.json()["pool"] == by_tenant.json()["pool"] == "p"
        r = admin.post("/route/explain", json={"tier": "gold", "request": request})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tier"
