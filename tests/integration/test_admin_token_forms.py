"""`KVGATE_ADMIN_TOKEN` as an operator writes it: ``id:token`` pairs with blanks around the
``:`` or the ``,`` each authenticate with the token alone, and the audit log names the id. A
real `kvgate serve`.

Before, ``ops: <token>`` kept the blank in the token: no request can present it (a header
value's leading blanks are dropped), so every request of that token's holders was a 401
"invalid admin token", with nothing said at start."""

from __future__ import annotations

import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc

OPS = "ops-token-0123456789abcdef"
AUDIT = "audit-token-0123456789abcdef"
CONFIG = {"pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
          "models": {"llama": {"free": "p"}}, "tiers": {"free": {}}}


def test_blanks_around_an_ids_colon_are_not_the_tokens() -> None:
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET,
           "KVGATE_ADMIN_TOKEN": f"ops: {OPS} , audit :{AUDIT}"}
    gw, base = gateway_proc(config=CONFIG, env=env, auth=True, ready=False)
    with gw:
        for ident, token in (("ops", OPS), ("audit", AUDIT)):
            with admin_client(base, token) as admin:
                made = admin.post("/tenants", json={"id": f"by-{ident}", "tier": "free"})
                assert made.status_code == 201, made.text
                entries = admin.get("/audit").json()["data"]
                assert entries[0]["who"] == ident, entries[0]


def test_a_tenants_key_is_refused_as_an_admin_token(redis_url: str) -> None:
    """A tenant's API key copied into KVGATE_ADMIN_TOKEN stops `kvgate serve` before anything
    listens, naming the rule, never the key. It started, and the key opened the admin API to
    its tenant (every tenant's keys, the policy) as well as the OpenAI routes."""
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": OPS,
           "KVGATE_REDIS_URL": redis_url}
    config = {**CONFIG, "tenants": [{"id": "acme", "tier": "free"}]}
    first, base = gateway_proc(config=config, env=env, auth=True, ready=False)
    with first, admin_client(base, OPS) as admin:
        made = admin.post("/tenants/acme/keys")
        assert made.status_code == 201, made.text
        key = str(made.json()["key"])
    second, base = gateway_proc(config=config, env={**env, "KVGATE_ADMIN_TOKEN": key},
                                auth=True, ready=False)
    try:
        with pytest.raises(RuntimeError) as exited:
            second.start()
    finally:
        second.stop()
    said = str(exited.value)
    assert "has the form of a tenant API key (kvg-...)" in said, said
    assert key not in said
