"""A new policy version that changes an existing pool, through the admin API of a real gateway
without a `models` section (the public names are then the pools' served names): its replicas
and its served name are followed at once, `/v1/models` included. (With a `models` section and
two gateways: tests/integration/test_e2e_tenancy.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
ADMIN = "policy-admin-token-0123456789"


def test_a_pools_replicas_and_served_name_follow_the_policy(sim_factory: SimFactory) -> None:
    _, old = sim_factory("--time-scale", "50", model="m-old")
    _, same = sim_factory("--time-scale", "50", model="m-old")
    _, new = sim_factory("--time-scale", "50", model="m-new")
    config = {"pools": {"p": {"served_model": "m-old", "replicas": [old]}}}
    gw, base = gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "t", "tier": "default"}).status_code == 201
        key = admin.post("/tenants/t/keys").json()["key"]
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)

        def answered_by(model: str) -> tuple[str, str]:
            raw = c.completions.with_raw_response.create(model=model, prompt="x", max_tokens=2)
            return "http://" + raw.headers["x-kvgate-replica"].partition("/")[2], \
                raw.parse().model

        def put(pool: dict[str, Any]) -> None:
            current = admin.get("/policy")
            doc = current.json()
            doc["pools"]["p"] = {**doc["pools"]["p"], **pool}
            resp = admin.put("/policy", json=doc, headers={"If-Match": current.headers["etag"]})
            assert resp.status_code == 200, resp.text

        assert answered_by("m-old") == (old, "m-old")
        put({"replicas": [same]})
        wait_for(lambda: answered_by("m-old") == (same, "m-old"), what="the re-listed replica")
        put({"replicas": [new], "served_model": "m-new"})
        wait_for(lambda: [m.id for m in c.models.list()] == ["m-new"], what="/v1/models")
        assert answered_by("m-new") == (new, "m-new")
        with pytest.raises(openai.NotFoundError):
            answered_by("m-old")
        assert httpx.get(f"{base}/readyz").status_code == 200


def test_a_replica_that_left_leaves_no_request_series(sim_factory: SimFactory) -> None:
    """Replica addresses churn (a new pod address at every rollout): a replica that left its
    pool and drained has its `kvgate_requests_total` series dropped once
    `upstream.total_timeout_s` has passed (they were kept for every address ever served)."""
    _, staying = sim_factory("--time-scale", "50", model="m")
    _, leaving = sim_factory("--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [staying, leaving]}},
              "routing": {"policy": "round_robin"}, "upstream": {"total_timeout_s": 2}}
    gw, base = gateway_proc(config=config, env={"KVGATE_ADMIN_TOKEN": ADMIN})
    with gw, admin_client(base, ADMIN) as admin:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30)

        def served() -> set[str]:
            found = metric_values(base, "kvgate_requests_total")
            return {"http://" + labels.split('replica="')[1].split('"')[0] for labels in found}

        for _ in range(4):
            c.completions.create(model="m", prompt="x", max_tokens=2)
        assert served() == {staying, leaving}
        resp = admin.patch("/policy", json={"pools": {"p": {"replicas": [staying]}}})
        assert resp.status_code == 200, resp.text
        c.completions.create(model="m", prompt="x", max_tokens=2)
        wait_for(lambda: served() == {staying}, timeout=20, what="the series of the replica gone")
