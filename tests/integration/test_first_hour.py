"""A new user's first hour, past the first five minutes (test_first_minutes.py): mistakes
made with the commands the README shows, and what each one answers -- the check meant to say
where `kvgate serve` would refuse to start, the demo's own flags, and the admin API's clients
given the OpenAI base URL a user already has at hand, and `--port 0` (any free port)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.gateway import AUTH_SECRET, gateway_proc, wait_for
from tests.support.procs import KVGATE, ROOT, Proc, free_port

ADMIN_TOKEN = "admin-token-0123456789"
SECRETS = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN}


def run(*args: str, env: dict[str, str] | None = None,
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": ""}
    return subprocess.run([*KVGATE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


def test_strict_check_refuses_workers_without_redis_as_serve_does(tmp_path: Path) -> None:
    """`--strict` exits 1 "where `kvgate serve` would refuse to start"; it passed a config
    with `server.workers: 2` and no KVGATE_REDIS_URL, which serve refuses."""
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump({"server": {"workers": 2}, "pools": {
        "a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}))
    serve = run("serve", "--config", str(path), "--port", str(free_port()), env=SECRETS)
    assert serve.returncode == 2 and "needs KVGATE_REDIS_URL" in serve.stderr
    strict = run("config", "check", "--strict", str(path), env=SECRETS)
    assert strict.returncode == 1, strict.stderr
    assert ("kvgate config: error: server.workers > 1 needs KVGATE_REDIS_URL" in strict.stderr
            and "`kvgate serve` will refuse to start" in strict.stderr)
    assert run("config", "check", str(path), env=SECRETS).returncode == 0  # a lint: warns
    with_redis = {**SECRETS, "KVGATE_REDIS_URL": "redis://127.0.0.1:6379/0"}  # not connected to
    done = run("config", "check", "--strict", str(path), env=with_redis)
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.parametrize(("flag", "value", "said"), [
    ("--time-scale", "0", "--time-scale: '0': expected a number above 0"),
    ("--time-scale", "-2", "--time-scale: '-2': expected a number above 0"),
    ("--log-level", "loud", "--log-level: invalid choice: 'loud'"),
])
def test_a_bad_demo_flag_is_named_before_any_replica_starts(flag: str, value: str,
                                                            said: str) -> None:
    """`--time-scale 0` started replicas that exited, then "a simulated replica did not start:
    kvgate sim exited with 2" (exit 1), the flag unnamed; `--log-level loud` was refused only
    after the four replicas had started."""
    result = run("demo", "--port", str(free_port()), flag, value)
    assert result.returncode == 2, result.stderr
    assert said in result.stderr
    assert "replica" not in result.stderr and "stopped" not in result.stderr


def test_the_admin_clients_given_a_url_with_v1_or_admin_say_to_drop_it() -> None:
    """`--url http://HOST:PORT/v1`, the base URL every snippet uses: the admin API's 404
    "Unknown path /v1/admin/tenants: kvgate serves /v1/chat/completions, ..." said nothing
    about --url; `--url .../admin` was "unknown admin path /admin/admin/tenants"."""
    gw, base = gateway_proc(upstreams=["http://127.0.0.1:9"], auth=True, ready=False,
                            env=SECRETS)
    env = {"KVGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    with gw:
        for cmd in (["admin", "--url", f"{base}/v1", "tenants", "list"],
                    ["admin", "--url", f"{base}/v1/", "audit"],
                    ["doctor", "--url", f"{base}/v1"]):
            result = run(*cmd, env=env)
            assert result.returncode == 2, result.stderr
            assert (f"--url {cmd[2]}: the admin API is at the gateway's address, not under "
                    f"/v1 (the OpenAI base URL): use --url {base}") in result.stderr
        for cmd in (["admin", "--url", f"{base}/admin", "tenants", "list"],
                    ["doctor", "--url", f"{base}/admin/"]):
            result = run(*cmd, env=env)
            assert result.returncode == 2, result.stderr
            assert (f"--url {cmd[2]}: the admin API is at the gateway's address, without "
                    f"/admin (added to each call): use --url {base}") in result.stderr
        assert run("admin", "--url", base, "tenants", "list", env=env).returncode == 0
        assert run("doctor", "--url", f"{base}/", env=env).returncode == 0


@pytest.mark.parametrize(("cmd", "line"), [
    (["serve", "--no-auth", "--upstream", "http://127.0.0.1:9"], r"listening on http://127\.0\.0\.1:(\d+)"),
    (["demo"], r"kvgate is up: http://127\.0\.0\.1:(\d+)/v1"),
])
def test_port_zero_says_the_port_it_got(cmd: list[str], line: str) -> None:
    """`--port 0` binds a free port; the line that says where to connect said `:0`."""
    proc = Proc([*KVGATE, *cmd, "--port", "0"], env={"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": ""})
    with proc:
        wait_for(lambda: re.search(line, proc.output()) is not None, timeout=60,
                 what="the line naming the address")
        found = re.search(line, proc.output())
        assert found is not None
        port = int(found[1])
        assert port != 0, proc.output()
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models",
                           headers={"Authorization": "Bearer demo"}, timeout=10)
        assert models.status_code == 200, models.text


@pytest.mark.parametrize("model", [[], ["--model", "m"]])
def test_replay_given_the_openai_base_url_says_to_drop_v1(model: list[str]) -> None:
    """`--target http://HOST:PORT/v1` ("a running kvgate's base URL", its help said) asked
    for /v1/v1/models: "GET /v1/models answered 404"; with --model, every request failed."""
    target = f"http://127.0.0.1:{free_port()}/v1"
    result = run("replay", "--synthetic", "--limit", "2", "--target", target, *model)
    assert result.returncode == 1, result.stderr
    assert (f"kvgate replay: --target {target}: the gateway's address, without /v1 (the "
            f"clients' base URL): --target {target.removesuffix('/v1')}") in result.stderr
    assert "without /v1" in run("replay", "--help").stdout


def test_upstream_with_kvgate_config_set_says_the_file_is_not_read(tmp_path: Path) -> None:
    """The quick form reads no file: with KVGATE_CONFIG exported (an image's environment, a
    shell's), every setting of that file -- port, tenancy, limits -- was dropped silently."""
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump({"server": {"port": 1}, "pools": {
        "a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}))
    port = free_port()
    gw = Proc([*KVGATE, "serve", "--no-auth", "--port", str(port), "--upstream",
               "http://127.0.0.1:9"], env={"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": str(path)},
              ready_url=f"http://127.0.0.1:{port}/healthz")
    with gw:
        gw.stop()
        assert (f"kvgate serve: warning: --upstream is the quick form: the file KVGATE_CONFIG "
                f"names ({path}) is not read") in gw.output()
    quiet = Proc([*KVGATE, "serve", "--no-auth", "--port", str(port), "--upstream",
                  "http://127.0.0.1:9"], env={"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": ""},
                 ready_url=f"http://127.0.0.1:{port}/healthz")
    with quiet:
        quiet.stop()
        assert "is not read" not in quiet.output()
