"""A config file the previous release started with still starts: a spill cycle only the
full check finds (two tiers spilling one pool to different pools) is a warning at start and
in `kvgate config check` (exit 0); a cycle the previous check refused is refused still.
Through the real `kvgate config check` process."""

from __future__ import annotations

import copy
from pathlib import Path

import httpx
import yaml

from gateway.admin import AdminToken
from gateway.config.fair_ids import unknown_fairness_tenants
from gateway.config.load import file_problems
from gateway.config.model import KvgateConfig
from gateway.policy_doc import PolicyDoc, parse_policy
from gateway.tenancy import InMemoryStore
from tests.integration.test_admin_api import ADMIN_TOKEN, POLICY_DOC, serve_admin
from tests.integration.test_cli_own_address import kvgate

AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}

POOLS = {"fp8": {"served_model": "m-fp8", "replicas": ["http://127.0.0.1:9001"]},
         "awq": {"served_model": "m-awq", "replicas": ["http://127.0.0.1:9002"]},
         "x": {"served_model": "m-x", "replicas": ["http://127.0.0.1:9003"]}}
HIDDEN = {"pools": POOLS, "models": {"m": {"default": "fp8", "c": "awq"}},
          "tiers": {"a": {"spill_to": "x"}, "b": {"spill_to": "awq"}, "c": {"spill_to": "fp8"}}}
PLAIN = {"pools": POOLS, "models": {"m": {"default": "fp8", "c": "awq"}},
         "tiers": {"b": {"spill_to": "awq"}, "c": {"spill_to": "fp8"}}}


def _write(tmp_path: Path, doc: dict[str, object]) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_cycle_the_old_check_missed_is_a_warning_not_a_refusal(tmp_path: Path) -> None:
    done = kvgate("config", "check", str(_write(tmp_path, HIDDEN)))
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert "spill cycle for model 'm': fp8 -> awq -> fp8" in out, out
    assert "previous release" in out and "at most once" in out, out
    assert "Traceback" not in out


def test_a_cycle_the_old_check_caught_is_still_refused(tmp_path: Path) -> None:
    done = kvgate("config", "check", str(_write(tmp_path, PLAIN)))
    assert done.returncode != 0, done.stdout
    assert "spill cycle for model 'm'" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_undefined_pools_leave_the_rest_of_the_file_judged() -> None:
    raw = {"server": {"prot": 1}, "pools": {"fp8": POOLS["fp8"]},
           "models": {"m": {"default": "fp8", "free": "awq"}}, "tiers": {"free": {}}}
    problem = file_problems(raw, "f.yaml", environ={})
    assert problem is not None and "server.prot" in problem, problem
    assert "not judged" in problem and "'awq'" in problem, problem
    secret = {**raw, "server": {}, "admin_token": "s" * 32}
    problem = file_problems(secret, "f.yaml", environ={})
    assert problem is not None and "admin_token" in problem, problem


def test_fairness_default_under_auth_without_a_default_tenant_is_warned() -> None:
    cfg = KvgateConfig.model_validate({
        "pools": {"fp8": POOLS["fp8"]}, "tenancy": {"auth": True},
        "tenants": [{"id": "acme", "tier": "default"}],
        "fairness": {"tenants": {"default": 2.0, "acme": 1.0}}})
    lines = unknown_fairness_tenants(cfg)
    assert any(line.startswith("fairness.tenants.default:") for line in lines), lines


async def test_a_patch_of_an_unrelated_field_over_a_cycle_in_force_is_taken() -> None:
    store = InMemoryStore()
    await store.put_policy(PolicyDoc.model_validate(HIDDEN))  # as an older release stored it
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        async with httpx.AsyncClient(base_url=url, headers=AUTH) as client:
            r = await client.patch("/admin/policy", json={"tiers": {"a": {"limits": {"rpm": 100}}}})
            assert r.status_code == 200, r.text  # it was a 400 for the cycle in force
            # a patch adding a cycle is refused still, OpenAI-shaped, naming what it adds
            r = await client.patch("/admin/policy",
                                   json={"models": {"n": {"default": "fp8", "c": "awq"}}})
            assert r.status_code == 400, r.text
            assert "spill cycle for model 'n'" in r.json()["error"]["message"], r.text
    snap = await store.get_policy()
    assert snap is not None and snap.doc.tiers["a"].limits.rpm == 100
    assert "n" not in snap.doc.models


async def test_fairness_default_refused_by_the_admin_api_by_the_same_rule() -> None:
    store = InMemoryStore()  # authenticated: no tenant `default` unless one is created
    await store.put_policy(parse_policy(POLICY_DOC))
    doc = copy.deepcopy(POLICY_DOC)
    doc["fairness"] = {"tenants": {"default": 2.0}}
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        async with httpx.AsyncClient(base_url=url, headers=AUTH) as client:
            r = await client.put("/admin/policy", json=doc)
            assert r.status_code == 400 and "fairness.tenants.default" in r.text, r.text
