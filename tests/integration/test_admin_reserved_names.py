"""Names the admin API refuses that it took: `none` for a tenant, tier or pool, and a public
model name with a control character.

`none` is the tenant, tier and pool label (metrics, the request log) of a request refused
before they were known (a 401): a tenant named `none` had its requests counted with every bad
key's. A model name with a CR LF was stored and shown raw wherever the models are listed.
And the refusal of a policy without a tier now says how to keep the default tier alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc
from tests.support.procs import sim_proc

ADMIN = "reserved-names-admin-token-01234"


@pytest.fixture(scope="module")
def admin() -> Iterator[httpx.Client]:
    sim, url = sim_proc(None, "--time-scale", "50", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [url]}},
              "models": {"llama": {"default": "p"}}}
    gw, base = gateway_proc(config=config, auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN})
    with sim, gw, admin_client(base, ADMIN) as client:
        yield client


def test_a_tenant_named_none_is_refused(admin: httpx.Client) -> None:
    r = admin.post("/tenants", json={"id": "none"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "id" and "reserved" in err["message"]
    assert admin.get("/tenants/none").status_code == 404  # nothing written
    assert admin.post("/tenants", json={"id": "none1"}).status_code == 201  # only that name


@pytest.mark.parametrize(("patch", "param"), [
    ({"tiers": {"none": {}}}, "tiers.none"),
    ({"pools": {"none": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}},
     "pools.none"),
    ({"models": {"x\r\ny": {"default": "p"}}}, "models"),
    ({"models": {"a\x1b[2Jb": {"default": "p"}}}, "models"),
])
def test_a_policy_naming_them_is_refused(
    admin: httpx.Client, patch: dict[str, Any], param: str
) -> None:
    before = admin.get("/policy")
    r = admin.patch("/policy", json=patch)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    after = admin.get("/policy")
    assert after.headers["etag"] == before.headers["etag"]  # nothing written
    assert after.json() == before.json()


def test_removing_the_last_named_tier_says_how(admin: httpx.Client) -> None:
    """`default` needs no entry beside other tiers, but a policy of it alone names it: the
    400 for removing the last named tier said only that a tier is required."""
    policy = admin.get("/policy").json()
    policy["tiers"] = {"free": {}}
    policy["models"] = {"llama": {"default": "p", "free": "p"}}
    assert admin.put("/policy", json=policy).status_code == 200
    drop = {"tiers": {"free": None}, "models": {"llama": {"free": None}}}
    r = admin.patch("/policy", json=drop)
    assert r.status_code == 400, r.text
    assert '{"default": {}}' in r.json()["error"]["message"]
    r = admin.patch("/policy", json={**drop, "tiers": {"free": None, "default": {}}})
    assert r.status_code == 200, r.text  # as the message says
    assert r.json()["tiers"] == {"default": {}}
