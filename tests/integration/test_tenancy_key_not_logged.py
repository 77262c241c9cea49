"""An API key a client pastes where its free text goes (the `model`) never reaches the log.

The request line logs the model the client asked for: a client that swapped its key and its
model (``OpenAI(api_key=MODEL)``, ``model=KEY``) had its key written to the gateway's log.
"""

from __future__ import annotations

import openai
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, wait_for
from tests.support.procs import sim_proc

ADMIN = "key-log-admin-token-0123456789ab"


def test_a_key_sent_as_the_model_is_not_logged() -> None:
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"default": "p"}},
              "tenants": [{"id": "acme", "tier": "default"}]}
    gw, base = gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with sim, gw, admin_client(base, ADMIN) as admin:
        key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model=key, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        wait_for(lambda: '"status":404' in gw.output(None), what="the request's log line")
        logged = gw.output(None)
        assert '"model":"kvg-***"' in logged  # the line is there, the key's shape said
        assert key[4:] not in logged
