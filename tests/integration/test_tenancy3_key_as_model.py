"""A client that swaps its key and its model (``model=<its key>``) gets a 404 that does not
echo the key: the message became the openai SDK's exception text (``Error code: 404 - {...
'The model `kvg-...` does not exist.' ...}``), which applications log. kvgate's own log
already showed it as ``kvg-***``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import sim_proc

ADMIN = "key-as-model-admin-token-0123456789"


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, str]]:
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"default": "p"}}, "tenants": [{"id": "acme"}]}
    gw, base = gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with sim, gw, admin_client(base, ADMIN) as admin:
        yield base, admin.post("/tenants/acme/keys").json()["key"]


def test_a_key_sent_as_the_model_is_not_echoed(gateway: tuple[str, str]) -> None:
    base, key = gateway
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=key, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2)
    assert key not in str(caught.value) and key[4:12] not in str(caught.value)
    assert "kvg-***" in str(caught.value)
    assert caught.value.code == "model_not_found"
    card = httpx.get(f"{base}/v1/models/{key}", headers={"Authorization": f"Bearer {key}"},
                     timeout=10)
    assert card.status_code == 404 and key not in card.text and "kvg-***" in card.text
