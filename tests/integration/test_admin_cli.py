"""`kvgate admin` against a real admin API on loopback."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from gateway.admin import AdminToken
from gateway.cli import admin as admin_cli
from gateway.config import load_config
from gateway.doctor import cli as doctor_cli
from gateway.errors import ConfigError
from gateway.policy_doc import parse_policy
from gateway.tenancy import InMemoryStore
from tests.integration.test_admin_api import ADMIN_TOKEN, POLICY_DOC, serve_admin
from tests.support.gateway import AUTH_SECRET, gateway_proc
from tests.support.procs import KVGATE, ROOT, Proc, free_port


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(admin_cli.main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_cli_round_trip(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        base = ["--url", url, "--token-env", "KVGATE_ADMIN_TOKEN"]
        code, out, _ = await _cli(
            capsys, *base, "tenants", "create", "acme", "--tier", "free", "--rpm", "10"
        )
        assert code == 0 and json.loads(out)["limits"] == {"rpm": 10}
        epoch = json.loads(out)["salt_epoch"]  # a fresh one: the rotation counts on from it
        # without --tier: the default tier, as for tenants in the config file
        code, out, _ = await _cli(capsys, *base, "tenants", "create", "solo")
        assert code == 0 and json.loads(out)["tier"] == "default"
        code, out, _ = await _cli(capsys, *base, "keys", "create", "acme")
        created = json.loads(out)
        assert code == 0 and created["key"].startswith("kvg-")
        code, out, err = await _cli(capsys, *base, "policy", "get")
        assert code == 0 and "version: 1" in err
        policy_file = tmp_path / "policy.json"
        policy_file.write_text(out)
        code, _, err = await _cli(
            capsys, *base, "policy", "put", str(policy_file), "--if-match", "1"
        )
        assert code == 0 and "version: 2" in err
        code, _, err = await _cli(
            capsys, *base, "policy", "put", str(policy_file), "--if-match", "1"
        )
        assert code == 1 and "412" in err
        code, out, _ = await _cli(capsys, *base, "rotate-salt", "acme")
        assert json.loads(out)["salt_epoch"] == epoch + 1
        code, out, _ = await _cli(capsys, *base, "keys", "revoke", "acme", created["id"])
        assert code == 0  # the API answers 204; the CLI confirms what it did
        assert json.loads(out) == {"revoked": True, "tenant": "acme", "id": created["id"]}
        code, out, _ = await _cli(capsys, *base, "audit", "--limit", "3")
        newest = json.loads(out)["data"][0]
        assert newest["action"] == "key.revoke"
        assert datetime.fromisoformat(newest["at"]).tzinfo is not None  # ISO 8601, UTC
        code, _, err = await _cli(capsys, *base, "tenants", "get", "ghost")
        assert code == 1 and "404" in err
        monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "wrong")
        code, _, err = await _cli(capsys, *base, "tenants", "list")
        assert code == 1 and "401" in err
        # the real entry point, in its own process: `kvgate admin ... tenants list`
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway.cli",
            "admin",
            *base,
            "tenants",
            "list",
            cwd=ROOT,
            env={"KVGATE_ADMIN_TOKEN": ADMIN_TOKEN, "PATH": ""},
            stdout=asyncio.subprocess.PIPE,
        )
        stdout, _ = await proc.communicate()
        assert proc.returncode == 0 and json.loads(stdout)["data"][0]["id"] == "acme"


async def test_multi_token_form_sends_the_first_token(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`KVGATE_ADMIN_TOKEN="ops:...,ci:..."`, as the gateway takes it, works in the same shell."""
    ci_token = ADMIN_TOKEN[::-1]
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", f"ops:{ADMIN_TOKEN},ci:{ci_token}")
    async for url in serve_admin(InMemoryStore(), [AdminToken("ops", ADMIN_TOKEN),
                                                   AdminToken("ci", ci_token)]):
        code, out, err = await _cli(capsys, "--url", url, "tenants", "list")
        assert code == 0, err
        assert json.loads(out)["data"] == []
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", "ops:short,ci:x")
    code, _, err = await _cli(capsys, "tenants", "list")
    assert code == 2 and "with id 'ops' has 5 characters" in err and "short" not in err


async def test_tenants_update_changes_only_what_is_given(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        base = ["--url", url]
        code, _, _ = await _cli(capsys, *base, "tenants", "create", "acme", "--rpm", "10")
        assert code == 0
        code, out, err = await _cli(capsys, *base, "tenants", "update", "acme", "--tier", "free",
                                    "--max-concurrency", "4")
        assert code == 0, err
        updated = json.loads(out)
        assert updated["tier"] == "free"
        assert updated["limits"]["max_concurrency"] == 4
        code, _, err = await _cli(capsys, *base, "tenants", "update", "acme")
        assert code == 2 and "nothing to change" in err
        code, _, err = await _cli(capsys, *base, "tenants", "update", "ghost", "--rpm", "1")
        assert code == 1 and "404" in err


async def test_tenants_update_clears_a_limit_override(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--rpm none` (any limit flag) removes the tenant's override: the tier's limit applies
    again (the API's `null`); anything but a positive integer or `none` is a usage error."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        base = ["--url", url]
        code, _, err = await _cli(capsys, *base, "tenants", "create", "acme", "--tier", "free",
                                  "--rpm", "10", "--tpm", "500", "--max-concurrency", "2")
        assert code == 0, err
        code, out, err = await _cli(capsys, *base, "tenants", "update", "acme", "--rpm", "none")
        assert code == 0, err
        assert json.loads(out)["limits"] == {"tpm": 500, "max_concurrency": 2}
        code, out, err = await _cli(capsys, *base, "tenants", "update", "acme", "--tpm", "None",
                                    "--max-concurrency", "none")
        assert code == 0, err
        assert json.loads(out)["limits"] == {}
        stored = await store.get_tenant("acme")
        assert stored is not None and stored.limits.model_dump(exclude_unset=True) == {}
        for bad in ("0", "-3", "unlimited"):
            code, _, err = await _cli(capsys, *base, "tenants", "update", "acme", "--rpm", bad)
            assert code == 2 and "a positive integer, or none" in err, (bad, err)


async def test_policy_patch_changes_only_what_it_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`kvgate admin policy patch FILE` sends a JSON merge patch: one changed field keeps the
    rest of the policy; `-` reads the patch from stdin; --if-match guards it as `put`."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        patch = tmp_path / "patch.yaml"
        patch.write_text("tiers: {free: {limits: {rpm: 30}}}\n")
        code, out, err = await _cli(capsys, "--url", url, "policy", "patch", str(patch),
                                    "--if-match", "1")
        assert code == 0 and "version: 2" in err, err
        doc = json.loads(out)
        assert doc["tiers"]["free"] == {"limits": {"rpm": 30, "max_concurrency": 4},
                                        "priority": 10}
        assert doc["pools"] == POLICY_DOC["pools"] and doc["models"] == POLICY_DOC["models"]
        code, _, err = await _cli(capsys, "--url", url, "policy", "patch", str(patch),
                                  "--if-match", "1")
        assert code == 1 and "412" in err
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(  # (read as bytes, decoded as UTF-8)
            io.BytesIO(b'{"tiers": {"premium": {"spill_to": null}}}')))
        code, out, err = await _cli(capsys, "--url", url, "policy", "patch", "-")
        assert code == 0, err
        assert "spill_to" not in json.loads(out)["tiers"]["premium"]


async def test_policy_put_takes_a_whole_config_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up warning's advice, `kvgate admin policy put kvgate.yaml`, works as written."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    example = ROOT / "examples" / "kvgate.yaml"
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        code, _, err = await _cli(capsys, "--url", url, "policy", "put", str(example))
        assert code == 0, err
        assert "sending only the policy sections" in err and "server" in err
        code, out, _ = await _cli(capsys, "--url", url, "policy", "get")
        assert set(json.loads(out)["pools"]) == set(yaml.safe_load(example.read_text())["pools"])


def test_main_port_with_a_separate_admin_port_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvgate admin` and `kvgate doctor` pointed at the public port while `server.admin_port`
    is set: the 404 says where the admin API is not, rather than a bare 404."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN,
           "KVGATE_SERVER__ADMIN_PORT": str(free_port())}
    gw, base = gateway_proc(upstreams=[f"http://127.0.0.1:{free_port()}"], ready=False,
                            auth=True, env=env)
    with gw:
        assert admin_cli.main(["--url", base, "tenants", "list"]) == 1
        err = capsys.readouterr().err  # one sentence after the 404's own, saying what to do
        assert "Unknown path /admin/tenants. The admin API is not on this port: point --url at " \
            "the gateway's admin port (server.admin_port)." in err, err
        assert doctor_cli.main(["--url", base]) == 1
        err = capsys.readouterr().err
        assert "Unknown path /admin/doctor. The admin API is not on this port: point --url at " \
            "the gateway's admin port (server.admin_port)." in err, err


def test_a_wrong_url_is_one_line_never_a_traceback() -> None:
    """`--url` at another HTTP server (its HTML 404), without a scheme, or at a closed port:
    one line saying what is wrong (the first used to print a JSONDecodeError traceback)."""
    env = {"KVGATE_ADMIN_TOKEN": ADMIN_TOKEN, "PATH": "/usr/bin:/bin"}

    def admin(url: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*KVGATE, "admin", "--url", url, "tenants", "list"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=30)

    port = free_port()
    with Proc([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
              ready_port=port):
        other = admin(f"http://127.0.0.1:{port}")
    assert other.returncode == 1, other.stderr
    assert "not a kvgate admin API answer (text/html" in other.stderr
    bare = admin(f"127.0.0.1:{port}")
    assert bare.returncode == 2 and "give the scheme" in bare.stderr
    closed = admin(f"http://127.0.0.1:{free_port()}")
    assert closed.returncode == 1 and "Connection refused" in closed.stderr
    # and what to do about it (it named the OS error only)
    assert "is kvgate running there? --url takes the gateway's port" in closed.stderr
    for result in (other, bare, closed):
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(("text", "reason"), [
    (b"pools:\n  a: [\n", "invalid YAML/JSON: expected the node content, but found "
                          "'<stream end>' at line 3, column 1"),
    # worded as `kvgate config check` words it (`gateway.yamlerror.not_utf8`)
    ("pools: {}\n".encode("utf-16"), "not UTF-8 text (byte 0xff at offset 0): save it as UTF-8"),
    # the first `tiers:` was dropped without a word (read as `kvgate config check` reads it)
    (b"tiers: {free: {priority: 1}}\npools: {}\ntiers: {gold: {}}\n",
     "invalid YAML/JSON: the key 'tiers' is repeated (only one would count) at line 3, "
     "column 1 (first given at line 1, column 1)"),
])
def test_an_unreadable_policy_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    text: bytes, reason: str,
) -> None:
    """Read before any call: PyYAML's text of several lines, or a UnicodeDecodeError's
    traceback for a UTF-16 file, used to be printed."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    path = tmp_path / "policy.yaml"
    path.write_bytes(text)
    for action in ("put", "patch"):
        assert admin_cli.main(["--url", f"http://127.0.0.1:{free_port()}", "policy", action,
                               str(path)]) == 1
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1, err
        assert err.startswith(f"kvgate admin: policy file {path}: {reason}"), err


def test_help_describes_every_command() -> None:
    """`kvgate admin --help` and its groups' --help say what each command does, and a missing
    command is named as such (argparse used to say "required: group", a variable's name)."""

    def admin(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*KVGATE, "admin", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=30)

    top = admin("--help").stdout
    assert "(default http://127.0.0.1:8000)" in " ".join(top.split())  # as wrapped
    for group, actions in {"tenants": ["create", "update", "list", "get", "delete"],
                           "keys": ["create", "revoke"], "policy": ["get", "put", "patch"],
                           "rotate-salt": [], "audit": []}.items():
        line = next(x for x in top.splitlines() if x.strip().startswith(group + " "))
        assert len(line.split()) > 1, f"{group} has no description"
        if actions:
            text = admin(group, "--help").stdout
            for action in actions:
                line = next(x for x in text.splitlines() if x.strip().startswith(action + " "))
                assert len(line.split()) > 1, f"{group} {action} has no description"
    assert "required: command" in admin().stderr
    assert "required: action" in admin("keys").stderr


async def test_tenants_list_prints_every_page(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API answers tenants a page at a time: `tenants list` follows the pages and prints
    them all as one list (here pages of 2)."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setattr(admin_cli, "PAGE", 2)
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        for tid in ("e", "a", "d", "c", "b"):
            code, _, err = await _cli(capsys, "--url", url, "tenants", "create", tid)
            assert code == 0, err
        code, out, err = await _cli(capsys, "--url", url, "tenants", "list")
        assert code == 0, err
        listed = json.loads(out)
        assert [t["id"] for t in listed["data"]] == ["a", "b", "c", "d", "e"]
        assert (listed["first_id"], listed["last_id"], listed["has_more"]) == ("a", "e", False)


def test_a_policy_file_not_utf8_is_worded_as_the_config_file_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One wording for one problem: `kvgate config check`/serve said where the bad byte is,
    `kvgate admin policy put|patch` did not (and read the file in the locale's encoding)."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    path = tmp_path / "policy.yaml"
    path.write_bytes(b"pools: {}\n# caf\xe9\n")  # Latin-1
    with pytest.raises(ConfigError) as config_error:
        load_config(str(path), environ={})
    config_reason = config_error.value.message.removeprefix(f"config file {path}: ")
    assert admin_cli.main(["--url", f"http://127.0.0.1:{free_port()}", "policy", "put",
                           str(path)]) == 1
    assert capsys.readouterr().err == f"kvgate admin: policy file {path}: {config_reason}\n"


def test_a_replicas_port_is_named_as_not_the_admin_api(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    """`--url` at a vLLM replica (vLLM's default port is kvgate's, 8000): its JSON 404 was
    printed as it came, `HTTP 404: {"detail":"Not Found"}`, saying nothing of --url."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    _, url = sim_factory()
    assert admin_cli.main(["--url", url, "tenants", "get", "acme"]) == 1
    err = capsys.readouterr().err
    assert err == (f"kvgate admin: HTTP 404 from {url}/admin/tenants/acme: not a kvgate admin "
                   "API answer ({\"detail\":\"Not Found\"}); check --url: --url takes the "
                   "gateway's port (its admin port when server.admin_port is set; `kvgate "
                   "epp`: its --http-port)\n")


async def test_a_missing_or_wrong_token_says_what_to_do(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No token: it said only "$KVGATE_ADMIN_TOKEN is not set"; a wrong one: "HTTP 401:
    invalid admin token", not which variable held it."""
    monkeypatch.delenv("KVGATE_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("OPS_TOKEN", "w" * 24)
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        code, _, err = await _cli(capsys, "--url", url, "tenants", "list")
        assert code == 2
        assert err == ("kvgate admin: $KVGATE_ADMIN_TOKEN is not set: export it with the "
                       "gateway's admin token (its KVGATE_ADMIN_TOKEN), or name another "
                       "variable with --token-env\n")
        code, _, err = await _cli(capsys, "--url", url, "--token-env", "OPS_TOKEN",
                                  "tenants", "list")
        assert code == 1
        assert err == ("kvgate admin: HTTP 401: invalid admin token ($OPS_TOKEN is not an "
                       "admin token of this gateway)\n")


@pytest.mark.parametrize(("patch", "line"), [
    ("tiers: {free: {rpm: 30}}",
     "tiers.free.rpm: unknown field (it belongs at tiers.free.limits.rpm)"),
    ("server: {port: 9000}",
     "server: unknown field (not a policy section: the policy is pools, models, tiers, "
     "fairness; server is read from the configuration at start)"),
    ("tiers: {free: {limits: {rmp: 30}}}",
     "tiers.free.limits.rmp: unknown field (did you mean rpm?)"),
])
async def test_a_policy_field_in_the_wrong_place_says_where_it_belongs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    patch: str, line: str,
) -> None:
    """The admin API's 400 for a policy field it does not know said pydantic's "Extra inputs
    are not permitted", where the config file's names where the field belongs."""
    monkeypatch.setenv("KVGATE_ADMIN_TOKEN", ADMIN_TOKEN)
    path = tmp_path / "patch.yaml"
    path.write_text(patch + "\n")
    store = InMemoryStore()
    await store.put_policy(parse_policy(POLICY_DOC))
    async for url in serve_admin(store, [AdminToken("ops", ADMIN_TOKEN)]):
        code, _, err = await _cli(capsys, "--url", url, "policy", "patch", str(path))
        assert (code, err) == (1, f"kvgate admin: HTTP 400: {line}\n")
