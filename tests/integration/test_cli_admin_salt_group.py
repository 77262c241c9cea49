"""`kvgate admin tenants update ID --salt-group none` against a real admin API: the limit
flags take `none` for "no value" (`--rpm none`: the tier's limit again), but `--salt-group
none` put the tenant in a group named "none" -- shared with every other tenant so "removed"
-- and the client had no way at all to leave a group. `none` now sends the API's null."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.admin import AdminToken
from gateway.cli import admin as admin_cli
from gateway.policy_doc import parse_policy
from gateway.tenancy import InMemoryStore
from tests.integration.test_admin_api import ADMIN_TOKEN, POLICY_DOC, serve_admin


async def _tenant(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code = await asyncio.to_thread(admin_cli.main, list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    tenant: dict[str, object] = json.loads(out)
    return tenant


async def test_salt_group_none_leaves_the_group(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        base = ["--url", url, "tenants"]
        made = await _tenant(capsys, *base, "create", "acme", "--salt-group", "team")
        assert made["salt_group"] == "team"
        left = await _tenant(capsys, *base, "update", "acme", "--salt-group", "none")
        assert left["salt_group"] is None
        alone = await _tenant(capsys, *base, "create", "solo", "--salt-group", "None")
        assert alone["salt_group"] is None
