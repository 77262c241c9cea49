"""Deeply nested JSON against a real gateway: a 400 in OpenAI's shape before any work, on the
proxied routes (nothing reaches the replica) and on the admin API (nothing is created)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "admin-token-0123456789abcdef"


def nested(depth: int) -> object:
    value: object = 1
    for i in range(depth - 1):
        value = {"k": value} if i % 2 else [value]
    return value


def raw_nested(depth: int) -> bytes:
    return b"[" * depth + b"1" + b"]" * depth


def test_deep_json_is_400_before_any_work(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim], auth=True,
                            env={"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "acme", "tier": "default"}).status_code == 201
        key = admin.post("/tenants/acme/keys").json()["key"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        for depth in (200, 300):  # (the SDK's own JSON encoder stops near 1000)
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="sim-model", prompt="x", max_tokens=1,
                                          extra_body={"vllm_xargs": nested(depth)})
            assert "deeper than" in err.value.message
        r = httpx.post(f"{base}/v1/completions", headers={"authorization": f"Bearer {key}"},
                       content=b'{"model": "sim-model", "prompt": "x", "x": '
                       + raw_nested(1000) + b"}")
        assert r.status_code == 400 and "deeper than" in r.json()["error"]["message"]
        assert httpx.get(f"{sim}/sim/stats").json()["received"] == 0  # never forwarded
        ok = client.completions.create(model="sim-model", prompt="x", max_tokens=1,
                                       extra_body={"vllm_xargs": nested(20)})
        assert ok.choices

        for method, path, body in (
            ("POST", "/tenants", b'{"id": "deep", "tier": "default", "limits": '
             + raw_nested(300) + b"}"),
            ("POST", "/tenants", b'{"id": "deep", "tier": "default", "limits": '
             + raw_nested(5000) + b"}"),
            ("PUT", "/policy", b'{"pools": ' + raw_nested(300) + b"}"),
        ):
            r = admin.request(method, path, content=body,
                              headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
            assert r.headers["content-type"].startswith("application/json")
            assert "deeper than" in r.json()["error"]["message"]
        assert admin.get("/tenants/deep").status_code == 404  # nothing was created
