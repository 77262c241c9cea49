"""What a client is told while the tenancy store (a real redis-server) answers every command of
the gateway with a refusal -- a wrong password, none, an ACL user that may not run kvgate's
scripts -- before anything was loaded: a 503 saying the store refuses, not that it "has not
answered yet; retry shortly" (which no retry cures), and never the password, Redis's address or
port (those are in the gateway's log and /readyz). The official openai client on the data
path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.redis_acl import password_redis

PASSWORD = "refusal-pass-Hw81"  # tests only
WRONG = "wrong-pass-Zp40"  # tests only
READER_PW = "reader-pw-Tq66"  # tests only
ADMIN = "refusal-admin-token-0123456789"


@pytest.fixture(scope="module")
def redis_port() -> Iterator[int]:
    """A redis-server with a password and an ACL user ``reader`` that may read and subscribe,
    not write nor run scripts."""
    with password_redis(PASSWORD, READER_PW) as port:
        yield port


@pytest.mark.parametrize(("userinfo", "told"), [
    (f":{WRONG}@", "refuses kvgate's credentials"),
    ("", "refuses kvgate's credentials"),
    (f"reader:{READER_PW}@", "refuses kvgate's commands (its ACL user lacks a permission"),
], ids=["wrong-password", "no-password", "acl-user"])
def test_a_client_hears_that_the_store_refuses(redis_port: int, userinfo: str, told: str) -> None:
    config: dict[str, Any] = {
        "pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
        "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
        "tenants": [{"id": "acme", "tier": "free"}],
    }
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": f"redis://{userinfo}127.0.0.1:{redis_port}/0"}
    gw, base = gateway_proc(config=config, env=env, auth=True, ready=False)
    with gw:
        wait_for(lambda: "store refuses kvgate's commands" in str(
            httpx.get(f"{base}/readyz", timeout=5).json()["tenancy"]["reason"]),
            timeout=20, what="/readyz naming the refusal")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="kvg-anything", max_retries=0,
                               timeout=10)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    answer = refused.value
    assert answer.status_code == 503
    error = answer.response.json()["error"]
    assert error["code"] == "store_unavailable"
    assert error["type"] == "ServiceUnavailableError"
    message = error["message"]
    assert message.startswith(f"the tenancy store (Redis) {told}"), message
    assert "has not answered" not in message
    for secret in (PASSWORD, WRONG, READER_PW, "reader", "127.0.0.1", str(redis_port)):
        assert secret not in answer.response.text
    assert int(answer.response.headers["retry-after"]) >= 1
