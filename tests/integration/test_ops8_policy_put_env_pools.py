"""`kvgate admin policy put FILE` judges the rest of the file as `kvgate serve --config` would,
with the environment it has.

A gateway whose pools come from ``KVGATE_POOLS__*`` variables (or `--upstream`) starts with a
file whose models name those pools; `policy put` judged the file alone and warned that
`kvgate serve` would refuse it ("unknown pool"), which it would not. With the variables set,
no warning; without them, a note saying what it could not judge, never "would refuse"."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.admin import AdminToken
from gateway.cli import admin as admin_cli
from gateway.policy_doc import parse_policy
from gateway.tenancy import InMemoryStore
from tests.integration.test_admin_api import ADMIN_TOKEN, POLICY_DOC, serve_admin

FILE: dict[str, Any] = {
    "server": {"port": 8000},
    "pools": {"fp8": {"served_model": "m-fp8", "replicas": ["http://127.0.0.1:9001"]}},
    "models": {"llama-70b": {"default": "fp8", "free": "awq"}},
    "tiers": {"free": {}},
}


async def _put(capsys: pytest.CaptureFixture[str], url: str, path: Path) -> str:
    await asyncio.to_thread(admin_cli.main, ["--url", url, "policy", "put", str(path)])
    return capsys.readouterr().err


async def test_pools_from_the_environment_are_no_reason_to_warn(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    path = tmp_path / "kvgate.yaml"
    await asyncio.to_thread(path.write_text, yaml.safe_dump(FILE))
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        err = await _put(capsys, url, path)  # no KVGATE_POOLS__AWQ__*: not judged
        assert "would refuse" not in err, err
        assert "not judged" in err and "'awq'" in err and "KVGATE_POOLS__" in err, err
        monkeypatch.setenv("KVGATE_POOLS__AWQ__REPLICAS", "[http://127.0.0.1:9002]")
        monkeypatch.setenv("KVGATE_POOLS__AWQ__SERVED_MODEL", "m-awq")
        err = await _put(capsys, url, path)  # as `kvgate serve --config` reads it: fine
        assert "would refuse" not in err and "not judged" not in err, err
        # a problem the environment makes is still named, with its variable
        monkeypatch.setenv("KVGATE_SERVER__PORT", "eighty")
        err = await _put(capsys, url, path)
        assert "would refuse" in err and "KVGATE_SERVER__PORT" in err, err
        assert "Traceback" not in err
