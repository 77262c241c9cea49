"""A policy put refused by a spill rule names what the put changed, or says the problem was
there before it.

With premium spilling to awq and an awq-only model `embed` beside `llama-70b`, removing
`llama-70b` was refused as "tiers.premium.spill_to: 'awq' is the tier's own pool for model
'embed' (spill cycle)": the operator touched `llama-70b`, not `embed`, and there is no cycle
(premium would just never spill). A cycle the old check missed (two tiers spilling one
pool's model to different pools were one edge) was reported on the next unrelated put as if
that put had made it. Through `kvgate admin policy put` against a served admin API."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.admin import AdminToken
from gateway.cli import admin as admin_cli
from gateway.policy_doc import PolicyDoc, parse_policy
from gateway.tenancy import InMemoryStore
from tests.integration.test_admin_api import ADMIN_TOKEN, serve_admin

POOLS = {"fp8": {"served_model": "m-fp8", "replicas": ["http://127.0.0.1:9001"]},
         "awq": {"served_model": "m-awq", "replicas": ["http://127.0.0.1:9002"]},
         "x": {"served_model": "m-x", "replicas": ["http://127.0.0.1:9003"]}}
WITH_EMBED: dict[str, Any] = {
    "pools": POOLS,
    "models": {"llama-70b": {"default": "fp8", "free": "awq"}, "embed": {"default": "awq"}},
    "tiers": {"premium": {"spill_to": "awq"}, "free": {}},
}
# fp8 -> awq (b) and awq -> fp8 (c) for model m: a cycle, hidden from the old check by tier
# a's fp8 -> x coming first
HIDDEN_CYCLE: dict[str, Any] = {
    "pools": POOLS,
    "models": {"m": {"default": "fp8", "c": "awq"}},
    "tiers": {"a": {"spill_to": "x"}, "b": {"spill_to": "awq"}, "c": {"spill_to": "fp8"}},
}


async def _put(capsys: pytest.CaptureFixture[str], url: str, path: Path,
               doc: dict[str, Any]) -> tuple[int, str]:
    await asyncio.to_thread(path.write_text, json.dumps(doc))
    code = await asyncio.to_thread(admin_cli.main, ["--url", url, "policy", "put", str(path)])
    return code, capsys.readouterr().err


async def test_removing_a_model_names_the_removal_not_another_model(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    store = InMemoryStore()
    await store.put_policy(parse_policy(WITH_EMBED))
    without = copy.deepcopy(WITH_EMBED)
    del without["models"]["llama-70b"]
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        code, err = await _put(capsys, url, tmp_path / "p.json", without)
        assert code != 0, err
        assert "tiers.premium.spill_to" in err, err
        assert "removes model 'llama-70b'" in err, err
        assert "would never spill" in err and "cycle" not in err, err
        assert "Traceback" not in err
        snap = await store.get_policy()
        assert snap is not None and "llama-70b" in snap.doc.models  # nothing half-applied
        # the fix the message offers is taken
        del without["tiers"]["premium"]["spill_to"]
        code, err = await _put(capsys, url, tmp_path / "p.json", without)
        assert code == 0, err


async def test_a_problem_of_the_policy_in_force_does_not_refuse_an_unrelated_write(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    store = InMemoryStore()
    # stored as a release with the old check stored it (the store does not check spills)
    await store.put_policy(PolicyDoc.model_validate(HIDDEN_CYCLE))
    unrelated = copy.deepcopy(HIDDEN_CYCLE)
    unrelated["tiers"]["a"]["limits"] = {"rpm": 100}
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        code, err = await _put(capsys, url, tmp_path / "p.json", unrelated)
        assert code == 0, err  # it was a 400 for a cycle the write did not make
        snap = await store.get_policy()
        assert snap is not None and snap.doc.tiers["a"].limits.rpm == 100
        # a write adding a second problem is refused, naming both
        worse = copy.deepcopy(unrelated)
        worse["models"]["n"] = {"default": "fp8", "c": "awq"}
        code, err = await _put(capsys, url, tmp_path / "p.json", worse)
        assert code != 0, err
        assert "already so in the policy in force" in err, err
        assert "spill cycle for model 'n'" in err, err
        assert "Traceback" not in err
