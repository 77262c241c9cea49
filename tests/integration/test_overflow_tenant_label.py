"""The `tenant` label of the tenants past the metrics' bound cannot be a tenant's own: a
tenant named `other` kept its label while every tenant past the bound was counted under the
same one, and a dashboard could not tell its requests from theirs. The overflow label is
`_other`, which no tenant id can be (an id starts with a letter or a digit).

A real gateway (allow-list `metrics_tenants: [other]`, and the first-N bound), a simulated
replica, the official openai client.
"""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from gateway.errors import KvgateError
from gateway.tenancy.models import Tenant
from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values
from tests.support.procs import Proc

ADMIN = "overflow-label-admin-token-0123456789"


def _tenant_labels(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for series, value in metric_values(base, "kvgate_requests_total").items():
        for part in series.strip("{}").split(","):
            if part.startswith("tenant="):
                label = part.split("=", 1)[1].strip('"')
                out[label] = out.get(label, 0.0) + value
    return out


@pytest.mark.parametrize("bound", [{"metrics_tenants": ["other"]},
                                   {"metrics_max_tenants": 1}])
def test_a_tenant_named_other_is_not_counted_with_the_overflow(
        sim_factory: Callable[..., tuple[Proc, str]], bound: dict[str, object]) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"free": "p"}}, "tiers": {"free": {}},
              "tenants": [{"id": t, "tier": "free"} for t in ("other", "b", "c")],
              "tenancy": bound}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    gw, base = gateway_proc(config=config, env=env, auth=True)
    with gw, admin_client(base, ADMIN) as admin:
        for tenant, times in (("other", 1), ("b", 2), ("c", 2)):  # `other` first: the N=1
            key = admin.post(f"/tenants/{tenant}/keys").json()["key"]
            client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            for _ in range(times):
                client.chat.completions.create(
                    model="llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert _tenant_labels(base) == {"other": 1.0, "_other": 4.0}


def test_the_overflow_label_is_no_tenant_id() -> None:
    with pytest.raises((ValueError, KvgateError)):
        Tenant(id="_other", tier="free")
