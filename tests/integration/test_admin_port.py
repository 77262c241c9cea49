"""`server.admin_port`: the admin API answers only on its own port, the OpenAI API only on the
main one (one server, one lifespan, the same tenancy state behind both)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.config import load_config
from gateway.errors import ConfigError
from tests.support.gateway import AUTH_SECRET, gateway_proc, metric_values
from tests.support.procs import Proc, free_port

ADMIN = "admin-port-test-token"


def test_admin_api_only_on_the_admin_port(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    admin_port = free_port()
    env = {
        "KVGATE_SALT_SECRET": AUTH_SECRET,
        "KVGATE_ADMIN_TOKEN": ADMIN,
        "KVGATE_SERVER__ADMIN_PORT": str(admin_port),
    }
    gw, base = gateway_proc(upstreams=[sim], auth=True, env=env)
    admin = f"http://127.0.0.1:{admin_port}"
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with gw:
        # the main port has no admin API (and no hint that it lives elsewhere), and no
        # /metrics (tenant ids, replica addresses): that moves to the admin port
        assert httpx.get(f"{base}/admin/audit", headers=auth).status_code == 404
        assert httpx.get(f"{base}/metrics").status_code == 404
        # the admin port has it, and nothing of the OpenAI API
        assert httpx.get(f"{admin}/healthz").status_code == 200
        made = httpx.post(
            f"{admin}/admin/tenants", json={"id": "t1", "tier": "default"}, headers=auth
        )
        assert made.status_code == 201, made.text
        key = httpx.post(f"{admin}/admin/tenants/t1/keys", headers=auth).json()["key"]
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        chat = {"model": "m", "messages": messages}
        hit = httpx.post(
            f"{admin}/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}"}
        )
        assert hit.status_code == 404
        # an OpenAI client given the admin port's address is told where its requests go
        assert hit.json()["error"]["message"] == (
            "Unknown path /v1/chat/completions on the admin port: it serves the admin API, "
            "/metrics, /healthz, /livez and /readyz only; OpenAI requests go to the gateway's "
            "API port (server.port; behind Envoy: Envoy's listener).")
        assert httpx.get(f"{admin}/admin/audit").status_code == 401
        # a key made on the admin port works on the main port: one state behind both
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        answer = client.chat.completions.create(model="m", messages=messages)
        assert answer.choices[0].message.content
        # the admin port's /metrics is the gateway's: it counted that request
        served = metric_values(admin, "kvgate_requests_total")
        assert sum(v for k, v in served.items() if 'status="200"' in k and 'tenant="t1"' in k) == 1


def test_admin_port_equal_to_the_main_port_is_rejected() -> None:
    with pytest.raises(ConfigError, match="admin_port"):
        load_config("", overrides={"server": {"port": 9000, "admin_port": 9000}})
