"""A config file the previous release started with still starts: a spill cycle only the
full check finds (two tiers spilling one pool to different pools) is a warning at start and
in `kvgate config check` (exit 0); a cycle the previous check refused is refused still.
Through the real `kvgate config check` process."""

from __future__ import annotations

from pathlib import Path

import yaml

from gateway.config.fair_ids import unknown_fairness_tenants
from gateway.config.load import file_problems
from gateway.config.model import KvgateConfig
from tests.integration.test_cli_own_address import kvgate

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
