"""`fairness.tenants` ids that no tenant has: a typo gave that tenant no share, in silence.

At run time (`PUT /admin/policy`, `kvgate admin policy put`) the store's tenants are known: an
id the write adds that is no tenant is refused (400 naming it), one the policy in force holds
already is kept. At start the store may hold tenants the file does not list (Redis), so the
file is not refused: `kvgate config check` and `kvgate serve` warn where they can tell."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gateway.admin import AdminToken
from gateway.cli import config as config_cli
from gateway.policy_doc import parse_policy
from gateway.tenancy import InMemoryStore
from tests.integration.test_admin_api import ADMIN_TOKEN, POLICY_DOC, serve_admin

AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def _weighted(**weights: float) -> dict[str, Any]:
    doc = copy.deepcopy(POLICY_DOC)
    doc["fairness"] = {"tenants": weights}
    return doc


async def test_a_runtime_write_refuses_a_weight_for_no_tenant() -> None:
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        async with httpx.AsyncClient(base_url=url, headers=AUTH) as client:
            created = await client.post("/admin/tenants", json={"id": "acme", "tier": "free"})
            assert created.status_code in (200, 201), created.text
            typo = await client.put("/admin/policy", json=_weighted(acne=4.0))
            assert typo.status_code == 400, typo.text
            error = typo.json()["error"]
            assert error["param"] == "fairness.tenants.acne", error
            assert "no tenant 'acne'" in error["message"], error
            ok = await client.put("/admin/policy", json=_weighted(acme=4.0))
            assert ok.status_code == 200, ok.text
            # the tenant deleted: a later write keeping its weight is not refused for it
            gone = await client.delete("/admin/tenants/acme")
            assert gone.status_code in (200, 204), gone.text
            doc = _weighted(acme=4.0)
            doc["tiers"]["free"]["limits"]["rpm"] = 30
            kept = await client.put("/admin/policy", json=doc)
            assert kept.status_code == 200, kept.text
            patched = await client.patch("/admin/policy",
                                         json={"fairness": {"tenants": {"bogus": 2.0}}})
            assert patched.status_code == 400 and "bogus" in patched.text, patched.text


def test_config_check_warns_of_a_weight_for_no_tenant_of_the_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KVGATE_REDIS_URL", raising=False)
    monkeypatch.setenv("KVGATE_SALT_SECRET", "x" * 40)
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    doc = _weighted(acne=4.0, acme=2.0)
    doc["tenants"] = [{"id": "acme", "tier": "free"}]
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert config_cli.main(["check", str(path)]) == 0
    err = capsys.readouterr().err
    assert "fairness.tenants.acne: no tenant 'acne'" in err, err
    assert "fairness.tenants.acme" not in err, err
