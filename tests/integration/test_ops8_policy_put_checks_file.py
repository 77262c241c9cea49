"""`kvgate admin policy put kvgate.yaml` warns when the rest of the file would not start a
gateway.

The runbook's way to add a pool is to edit the config file and send it with `policy put`; only
its policy sections are sent. A typo elsewhere in it (`server.prot`) was passed over in
silence, exit 0, and surfaced only at the next restart, every pod refusing the file. The put
still goes through (the policy is valid), with a warning naming the field."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from gateway.admin import AdminToken
from gateway.cli import admin as admin_cli
from gateway.policy_doc import parse_policy
from gateway.tenancy import InMemoryStore
from tests.integration.test_admin_api import ADMIN_TOKEN, POLICY_DOC, serve_admin
from tests.support.procs import ROOT


async def _put(capsys: pytest.CaptureFixture[str], url: str, path: Path) -> tuple[int, str]:
    code = await asyncio.to_thread(admin_cli.main, ["--url", url, "policy", "put", str(path)])
    return code, capsys.readouterr().err


async def test_a_typo_outside_the_policy_is_named_and_the_policy_is_sent(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    example = yaml.safe_load((ROOT / "examples" / "kvgate.yaml").read_text())
    good = tmp_path / "kvgate.yaml"
    good.write_text(yaml.safe_dump(example))
    example["server"]["prot"] = example["server"].pop("port")
    example["upstream"]["max_attempts"] = "two"
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(example))
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        code, err = await _put(capsys, url, good)
        assert code == 0, err
        assert "warning" not in err  # the shipped example starts a gateway
        code, err = await _put(capsys, url, typo)
        assert code == 0, err
        assert "would refuse this file at its next restart" in err, err
        assert "server.prot: unknown field (did you mean port?)" in err, err
        assert "upstream.max_attempts:" in err, err
        assert "Traceback" not in err
        stored = await store.get_policy()
        assert stored is not None and set(stored.doc.pools) == set(example["pools"])
