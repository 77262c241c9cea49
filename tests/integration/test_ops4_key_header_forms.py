"""Header and store forms the fourth operations review found misread.

``Authorization: Bearer<TAB><key>`` (a horizontal tab between the scheme and the credentials,
which HTTP allows as whitespace in a field value) was read as no key at all: the client got
a 401 "missing API key" for a key it did send, on the proxy and on the admin API alike.

A key of another type at ``<ns>:salt_secrets`` (an operator's or another application's string)
made every salt-secret check fail with WRONGTYPE, which the check swallowed: gateways started
with different secrets went on answering ready, not degraded, with nothing in the log.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import redis

from tests.support.gateway import AUTH_SECRET, admin_client, chat_status, gateway_proc, wait_for
from tests.support.procs import Proc, sim_proc

ADMIN = "ops4-header-admin-token-0123456789"


def _config(url: str) -> dict[str, Any]:
    return {"pools": {"p": {"served_model": "m", "replicas": [url]}},
            "models": {"llama": {"default": "p"}},
            "tenants": [{"id": "acme", "tier": "default"}]}


def test_a_tab_after_bearer_still_presents_the_key(procs: list[Proc]) -> None:
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    procs.append(sim.start())
    gw, base = gateway_proc(config=_config(url), auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    procs.append(gw.start())
    with admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    assert chat_status(client) == 200  # the key works the ordinary way
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for header in (f"Bearer\t{key}", f"bearer \t {key}"):
        answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30,
                            headers={"Authorization": header})
        assert answer.status_code == 200, answer.text
    # the admin API reads its token the same way
    listed = httpx.get(f"{base}/admin/tenants", timeout=10,
                       headers={"Authorization": f"Bearer\t{ADMIN}"})
    assert listed.status_code == 200, listed.text
    # a wrong key after a tab is still refused, as invalid (not as missing)
    wrong = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30,
                       headers={"Authorization": "Bearer\tkvg-not-a-key"})
    assert wrong.status_code == 401
    assert "invalid or revoked" in wrong.json()["error"]["message"]


def test_a_salt_secrets_key_of_another_type_is_said(redis_url: str, procs: list[Proc]) -> None:
    r = redis.Redis.from_url(redis_url)
    r.set("kvgate:salt_secrets", "written by hand")
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    procs.append(sim.start())
    gw, base = gateway_proc(config=_config(url), auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
        "KVGATE_REDIS_URL": redis_url})
    procs.append(gw.start())

    def reason() -> str:
        return str(httpx.get(f"{base}/readyz", timeout=10).json()["tenancy"]["reason"] or "")

    # the gateway's first check is done before it answers /readyz
    said = reason()
    assert "kvgate:salt_secrets" in said and "salt secret" in said, said
    assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200  # still serving
    assert AUTH_SECRET not in gw.output(None) and AUTH_SECRET not in said
    assert "kvgate:salt_secrets" in gw.output(None)  # the log names the key to delete
    r.delete("kvgate:salt_secrets")  # the operator's fix: the next check works again
    wait_for(lambda: "salt_secrets" not in reason(), timeout=60, what="the check back")
    assert r.type("kvgate:salt_secrets") == b"hash"
