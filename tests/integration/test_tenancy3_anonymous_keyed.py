"""A ``--no-auth`` gateway on a tenancy store shared with authenticated gateways serves its
callers as the store's tenant `default`. Once that tenant has API keys it is a customer of the
authenticated gateways: the anonymous callers shared its cache salt and spent its limits (its
own next request was a 429 for the requests they made). The anonymous gateway now refuses
(503 saying why) rather than serve anyone as a keyed tenant."""

from __future__ import annotations

import httpx
import openai

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, wait_for
from tests.support.procs import Proc, sim_proc

ADMIN = "anonymous-keyed-admin-token-0123456789"
BODY = {"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _anonymous_status(base: str) -> int:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="anything", max_retries=0)
    try:
        return client.chat.completions.with_raw_response.create(
            model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2).status_code
    except openai.APIStatusError as exc:
        return exc.status_code


def test_anonymous_gateway_refuses_to_serve_as_a_keyed_tenant(
        redis_url: str, procs: list[Proc]) -> None:
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    procs.append(sim.start())
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"default": "p"}}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url}
    keyed, a = gateway_proc(config=config, env=env, auth=True)
    procs.append(keyed.start())
    anonymous, b = gateway_proc(config=config, env=env)  # --no-auth, same store
    procs.append(anonymous.start())
    assert _anonymous_status(b) == 200  # `default` has no key: the anonymous gateway's own
    with admin_client(a, ADMIN) as admin:
        made = admin.post("/tenants/default/keys")
        assert made.status_code == 201, made.text
        key = made.json()["key"]
    wait_for(lambda: _anonymous_status(b) == 503, timeout=30, what="the anonymous gateway refuses")
    refused = httpx.post(f"{b}/v1/chat/completions", json=BODY, timeout=10)
    assert refused.status_code == 503
    error = refused.json()["error"]
    assert "--no-auth" in error["message"] and "has API keys" in error["message"]
    assert key not in refused.text and AUTH_SECRET not in refused.text
    client = openai.OpenAI(base_url=f"{a}/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=2)  # the key's own gateway serves it
    assert "has API keys" in anonymous.output(tail=None)
