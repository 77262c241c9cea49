"""Through the Envoy endpoint picker as at kvgate's own edge: a stored response's GET whose
home Redis does not answer for is a 503 to retry, not a 404 telling its owner the response
is gone (the picker took the failed lookup as "not found").

A real `kvgate epp` on a real redis-server, a real Envoy, a simulator keeping responses; a
second gateway (kvgate serve on the same Redis) relays the response, so the picker knows
its home only through Redis."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import openai
import pytest

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc, redis_proc

ADMIN = "epp-stored-lookup-admin-token-0123456789"


def test_a_get_whose_home_redis_does_not_answer_is_a_503_at_the_picker(
        sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    _, sim = sim_factory("--time-scale", "50", "--enable-store", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
              "tenants": [{"id": "acme", "tier": "free"}]}
    redis, url = redis_proc()
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": url}
    with ExitStack() as stack:
        stack.enter_context(redis)
        gw, base = gateway_proc(config=config, env=env, auth=True)
        stack.enter_context(gw)
        epp = epp_proc(config=config, auth=True, env=env)
        stack.enter_context(epp)
        envoy, edge = envoy_proc(epp.picker)
        stack.enter_context(envoy)
        with admin_client(base, ADMIN) as admin:
            key = admin.post("/tenants/acme/keys").json()["key"]
        direct = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)
        picked = openai.OpenAI(base_url=f"{edge}/v1", api_key=key, max_retries=0, timeout=30)
        made = direct.responses.create(model="llama", input="Hello", max_output_tokens=4)
        other = direct.responses.create(model="llama", input="Hi", max_output_tokens=4)
        assert picked.responses.retrieve(made.id).id == made.id  # its home, from Redis
        redis.stop()
        with pytest.raises(openai.APIStatusError) as caught:
            picked.responses.retrieve(other.id)
        resp = caught.value.response
        assert resp.status_code == 503, resp.text  # was a 404: "your response is gone"
        assert int(resp.headers["retry-after"]) >= 1
