"""A tenant's limit override set to null returns it to its tier's limit; it never lifts it.

`PATCH /admin/tenants/{id}` with `{"limits": {"rpm": null}}` used to store an explicit null,
which the limiter read as "unlimited": the tier's rpm was silently off for that tenant, and
there was no way back to the tier's default short of deleting the tenant and its keys."""

from __future__ import annotations

from collections.abc import Callable

import openai

from tests.support.gateway import AUTH_SECRET, admin_client, chat_status, gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "override-admin-token-0123456789"


def test_a_null_override_means_the_tiers_limit(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    config = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}},
        "tiers": {"free": {"limits": {"rpm": 2}}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw, admin_client(base, ADMIN) as admin:
        patched = admin.patch("/tenants/acme", json={"limits": {"rpm": 1000}})
        assert patched.json()["limits"] == {"rpm": 1000}
        patched = admin.patch("/tenants/acme", json={"limits": {"rpm": None}})
        assert patched.status_code == 200 and patched.json()["limits"] == {}
        created = admin.post("/tenants", json={"id": "beta", "tier": "free",
                                               "limits": {"rpm": None}})
        assert created.status_code == 201 and created.json()["limits"] == {}
        for tenant in ("acme", "beta"):
            key = admin.post(f"/tenants/{tenant}/keys").json()["key"]
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            raw = client.chat.completions.with_raw_response.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert raw.headers.get("x-ratelimit-limit-requests") == "2", tenant
            statuses = [chat_status(client) for _ in range(3)]
            assert 429 in statuses, (tenant, statuses)
