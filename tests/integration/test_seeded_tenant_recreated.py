"""A tenant seeded from the configuration file, deleted through the admin API and seeded again
at the gateway's next start, starts with its whole limits; and a restart whose configuration
gives a stored tenant another tier says that the stored one is used. A real `kvgate serve` on
a real redis-server, a simulated replica, the official openai client.

Before, a seeded tenant had no incarnation: its rate limits were kept under its id alone, so
the one seeded again inherited the deleted one's spent budget (its first request a 429
"requests per minute", Retry-After 30 on a 2 RPM tier); and a tier changed in the file was
ignored without a word (the store owns its tenants, as it owns the policy, which said so)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import orjson

from tests.support.gateway import AUTH_SECRET, admin_client, chat_status, gateway_proc
from tests.support.procs import Proc

ADMIN = "seeded-again-admin-token-0123456789"


def _config(sim: str, tier: str) -> dict[str, Any]:
    return {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
            "models": {"llama": {"rpm": "p", "gold": "p"}},
            "tiers": {"rpm": {"limits": {"rpm": 2}}, "gold": {"limits": {"rpm": 100}}},
            "tenants": [{"id": "acme", "tier": tier}]}


def _gateway(sim: str, redis_url: str, tier: str = "rpm") -> tuple[Proc, str]:
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    return gateway_proc(config=_config(sim, tier), env=env, auth=True)


def _client(base: str) -> openai.OpenAI:
    with admin_client(base, ADMIN) as admin:
        made = admin.post("/tenants/acme/keys")
        assert made.status_code == 201, made.text
        key = str(made.json()["key"])
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


def _warnings(gw: Proc) -> list[str]:
    out = []
    for line in gw.output(tail=None).splitlines():
        if line.startswith("{"):
            doc = orjson.loads(line)
            if doc["level"] == "warning" and doc["logger"] == "gateway.tenancy.service":
                out.append(str(doc["msg"]))
    return out


def test_a_seeded_tenant_deleted_and_seeded_again_starts_with_its_whole_budget(
        sim_factory: Callable[..., tuple[Proc, str]], redis_url: str) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    gw, base = _gateway(sim, redis_url)
    with gw:
        client = _client(base)
        assert [chat_status(client) for _ in range(3)] == [200, 200, 429]  # its 2 a minute
        with admin_client(base, ADMIN) as admin:
            assert admin.delete("/tenants/acme").status_code == 204
    gw, base = _gateway(sim, redis_url)  # the configuration still lists it: seeded again
    with gw:
        client = _client(base)
        assert [chat_status(client) for _ in range(3)] == [200, 200, 429]
        warnings = _warnings(gw)
    assert any("created again from the configuration, without API keys: 'acme'" in w
               for w in warnings), warnings


def test_a_tier_changed_in_the_file_is_said_to_be_overridden_by_the_store(
        sim_factory: Callable[..., tuple[Proc, str]], redis_url: str) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    gw, base = _gateway(sim, redis_url)
    with gw:
        assert _warnings(gw) == []  # the first start seeds it: nothing to say
    gw, base = _gateway(sim, redis_url, tier="gold")
    with gw, admin_client(base, ADMIN) as admin:
        assert admin.get("/tenants/acme").json()["tier"] == "rpm"  # the stored one, in force
        warnings = _warnings(gw)
    assert any("configured tenants differ from the tenancy store's" in w and "'acme' (tier)" in w
               for w in warnings), warnings
