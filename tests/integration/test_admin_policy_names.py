"""A pool's or a tier's name in a policy written through the admin API is a name as a tenant's
id is (letters, digits, '.', '_', '-'): anything else is a 400 naming the field, and the policy
in force does not change. A real `kvgate serve` on a real redis-server, a simulated replica, the
official openai client.

Before, any string was taken: a pool named with a CR LF in it was stored, and every request
routed there got no answer at all (its ``x-kvgate-replica`` header could not be written); one
with '/' made that header ambiguous, an empty one was mapped but never found (404)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, chat_status, gateway_proc
from tests.support.procs import Proc

ADMIN = "policy-names-admin-token-0123456789"


@pytest.mark.parametrize("name", ["q\r\nx-evil: 1", "q/x", "", " q", "q\x00", "q\u00e9", "a#b"],
                         ids=["crlf", "slash", "empty", "blank", "nul", "non-ascii", "hash"])
def test_a_pool_or_tier_name_that_is_no_name_is_refused(
        sim_factory: Callable[..., tuple[Proc, str]], redis_url: str, name: str) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    config: dict[str, Any] = {
        "pools": {"p": {"served_model": "m", "replicas": [sim]}},
        "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
        "tenants": [{"id": "acme", "tier": "free"}], "server": {"replica_header": True}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        before = admin.get("/policy").headers["etag"]
        pool = {"served_model": "m", "replicas": [sim.replace("127.0.0.1", "localhost")]}
        patches = (("pools", {"pools": {name: pool}, "models": {"llama": {"free": name}}}),
                   ("tiers", {"tiers": {name: {}}, "models": {"llama": {name: "p"}}}))
        for field, patch in patches:
            refused = admin.patch("/policy", json=patch)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["type"] == "BadRequestError"
            assert error["message"].startswith(f"{field}"), error
            if (field, name) != ("tiers", ""):  # (an empty tier's name: refused already)
                assert error["message"].startswith(f"{field}: "), error
                assert "is not a name: 1 to 64 letters, digits" in error["message"], error
            assert admin.get("/policy").headers["etag"] == before  # nothing changed
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
        assert chat_status(client) == 200
