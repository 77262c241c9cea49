"""Every config file under examples/ serves requests as it is written (README: "start from
examples/kvgate.yaml"): its pools behind real simulated replicas -- the replica lists replaced
through `KVGATE_POOLS__<POOL>__REPLICAS`, as the file names fixed ports --, a key for a tenant
of each tier its models name, and one chat completion per public model and tier through the
official openai client, answered by that tier's pool under its served name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import ROOT, Proc

ADMIN = "examples-admin-token-0123456789"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert EXAMPLES, "examples/ holds no config file"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_serves_each_model_and_tier(
    path: Path, sim_factory: Callable[..., tuple[Proc, str]]
) -> None:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN}
    for name, pool in doc["pools"].items():
        assert name.isidentifier(), f"pool {name!r} cannot be named in a variable"
        policy = ["--scheduling-policy", "priority"] if pool.get("priority") else []
        _, url = sim_factory("--time-scale", "50", *policy,
                             model=pool.get("served_model") or "sim-model")
        env[f"KVGATE_POOLS__{name.upper()}__REPLICAS"] = f"[{url}]"
    gw, base = gateway_proc(args=["--config", str(path)], auth=True, env=env)
    with gw, admin_client(base, ADMIN) as admin:
        keys = {}
        for tier in sorted({t for tiers in doc["models"].values() for t in tiers}):
            tenant = f"t-{tier}"
            assert admin.post("/tenants", json={"id": tenant, "tier": tier}).status_code == 201
            keys[tier] = admin.post(f"/tenants/{tenant}/keys").json()["key"]
        for model, tiers in doc["models"].items():
            for tier, pool in tiers.items():
                client = openai.OpenAI(base_url=f"{base}/v1", api_key=keys[tier], max_retries=0)
                raw = client.chat.completions.with_raw_response.create(
                    model=model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
                assert raw.headers["x-kvgate-replica"].startswith(f"{pool}/"), (model, tier)
                served = doc["pools"][pool].get("served_model")
                assert raw.parse().model == (served or "sim-model")
