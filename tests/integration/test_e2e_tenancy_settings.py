"""Tenancy settings from the configuration file, end to end through a real gateway: the salt
secret from `salt_secret_file`, `client_salt: reject`, `metrics_max_tenants`, and TPM settled
with the real usage of a finished request (not the estimate, not 0)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.tenancy import SaltDeriver
from tests.support.gateway import admin_client, gateway_proc, metric_values
from tests.support.procs import Proc, sim_proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "settings-admin-token-0123456789"
FILE_SECRET = "salt-from-a-file-0123456789abcdef"


@dataclass
class Gateway:
    base: str
    sim: str
    keys: dict[str, str]

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=self.keys[tenant],
                             max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    secret_file: Path = tmp_path_factory.mktemp("secrets") / "salt"
    secret_file.write_text(FILE_SECRET + "\n")
    sim, sim_url = sim_proc(None, "--time-scale", "50", model="m")
    config = {
        "pools": {"p": {"served_model": "m", "replicas": [sim_url]}},
        "models": {"llama": {"free": "p", "metered": "p"}},
        "tiers": {"free": {}, "metered": {"limits": {"tpm": 100}}},
        "tenants": [{"id": "a", "tier": "free"}, {"id": "b", "tier": "free"},
                    {"id": "m", "tier": "metered"}],
        "tenancy": {"salt_secret_file": str(secret_file), "client_salt": "reject",
                    "metrics_max_tenants": 1},
    }
    # no KVGATE_SALT_SECRET: authentication can only start with the file's secret
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN}, auth=True)
    with sim, gw, admin_client(base, ADMIN) as admin:
        keys = {t: admin.post(f"/tenants/{t}/keys").json()["key"] for t in ("a", "b", "m")}
        yield Gateway(base, sim_url, keys)


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model="llama", messages=[{"role": "user", "content": "Hello"}], **kw)


def _sent(sim: str, request_id: str) -> dict[str, Any]:
    for item in httpx.get(f"{sim}/sim/requests", timeout=5).json()["requests"]:
        sent = item["headers"].get("x-request-id", "")  # a client's: kvgate's id appended
        if sent == request_id or sent.startswith(f"{request_id}-"):
            body: dict[str, Any] = item["body"]
            return body
    raise AssertionError(f"request {request_id} never reached the replica")


def test_the_salt_secret_comes_from_salt_secret_file(gateway: Gateway) -> None:
    raw = chat(gateway.client("a"), max_tokens=2)
    expected = SaltDeriver(FILE_SECRET).derive("tenant:a", 0)
    assert _sent(gateway.sim, raw.headers["x-request-id"])["cache_salt"] == expected


def test_client_salt_reject_from_the_config_file(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(gateway.client("a"), max_tokens=2, extra_body={"cache_salt": "mine"},
             extra_headers={"x-request-id": "rejected-salt-1"})
    assert isinstance(err.value.body, dict), err.value.body
    assert err.value.body["param"] == "cache_salt"
    with pytest.raises(AssertionError):  # refused before any replica saw it
        _sent(gateway.sim, "rejected-salt-1")


def test_metrics_max_tenants_bounds_the_tenant_label(gateway: Gateway) -> None:
    for tenant in ("a", "b", "m", "b"):
        chat(gateway.client(tenant), max_tokens=2)
    labels = {
        part.split("=", 1)[1].strip('"')
        for series in metric_values(gateway.base, "kvgate_requests_total")
        for part in series.strip("{}").split(",") if part.startswith("tenant=")
    }
    assert labels == {"a", "_other"}  # 'a' was the first seen; one label, then "_other"


def test_tpm_is_settled_with_the_real_usage(gateway: Gateway) -> None:
    client = gateway.client("m")  # tier 'metered': 100 tokens per minute
    first = chat(client, max_tokens=150, extra_body={"ignore_eos": True})
    usage = first.parse().usage
    assert usage.total_tokens > 150  # the estimate at admission was a few prompt tokens
    # settled with the real usage the bucket is ~50 tokens in debt: the next one waits
    with pytest.raises(openai.RateLimitError) as err:
        chat(client, max_tokens=2)
    assert int(err.value.response.headers["retry-after"]) >= 20
