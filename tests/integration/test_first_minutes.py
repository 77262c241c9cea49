"""A new user's first five minutes, each command run as the README or the issue writes it:
`kvgate --version`, the venv on PATH, an upstream that is down at start (503 + Retry-After, and
`/v1/models` naming the pool that is not ready), vLLM's operational paths (`/health`, `/ping`,
`/version`), start-up warnings about missing secrets, a port already in use, clean logs."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import yaml

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, wait_for
from tests.support.procs import KVGATE, ROOT, Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]
ANSI = re.compile(r"\x1b\[")


def run(*args: str, env: dict[str, str] | None = None,
        timeout: float = 30) -> subprocess.CompletedProcess[str]:
    base = {"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": ""}
    return subprocess.run([*KVGATE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**base, **(env or {})})


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_version_flag() -> None:
    result = run("--version")
    assert result.returncode == 0
    assert re.fullmatch(r"kvgate \S+\n", result.stdout)


def test_readme_puts_the_venv_on_path(tmp_path: Path) -> None:
    """The README's line for a new shell, run in a shell with a bare PATH, finds `kvgate`."""
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"^(\. \.venv/bin/activate)\b", readme, re.M)
    assert line, "README must say how to put the venv on PATH"
    venv = Path(KVGATE[0]).parent.parent  # the venv this test runs in
    if venv.resolve() != (ROOT / ".venv").resolve():
        # not the project's .venv (e.g. another checkout's): point .venv at this one
        (tmp_path / ".venv").symlink_to(venv)
        cwd = tmp_path
    else:
        cwd = ROOT
    result = subprocess.run(["bash", "--noprofile", "--norc", "-c",
                             f"{line.group(1)} && kvgate --version"],
                            cwd=cwd, capture_output=True, text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("kvgate ")


def test_upstream_down_at_start_is_503_not_404() -> None:
    gw, base = gateway_proc(upstreams=[f"http://127.0.0.1:{free_port()}"], ready=False)
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 503
        assert "No ready replica for the model `m`" in err.value.message
        assert err.value.response.headers["retry-after"].isdigit()
        assert client.models.list().data == []
        models = httpx.get(f"{base}/v1/models").json()
        assert [p["pool"] for p in models["not_ready"]] == ["default"]


def test_vllm_operational_paths(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        for path in ("/health", "/ping"):
            assert httpx.get(f"{base}{path}").status_code == 200, path
        version = httpx.get(f"{base}/version").json()["version"]
        assert version == run("--version").stdout.split()[1]
    # /health is liveness, like /healthz: 200 while no replica is up
    gw, base = gateway_proc(upstreams=[f"http://127.0.0.1:{free_port()}"], ready=False)
    with gw:
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/readyz").status_code == 503


def test_auth_without_admin_token_or_tenants_warns_loudly() -> None:
    gw, _ = gateway_proc(upstreams=[f"http://127.0.0.1:{free_port()}"], ready=False,
                         auth=True, env={"KVGATE_SALT_SECRET": AUTH_SECRET})
    with gw:
        gw.stop()
        assert "nobody can create an API key" in gw.output()


def test_config_check_warns_about_missing_secrets(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump(
        {"pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}))
    result = run("config", "check", str(path))
    assert result.returncode == 0  # a lint: the secrets may live elsewhere (e.g. in CI)
    assert "KVGATE_SALT_SECRET" in result.stderr and "KVGATE_ADMIN_TOKEN" in result.stderr
    assert "nobody can ever get an API key" in result.stderr
    # `kvgate serve` would refuse to start without the salt secret
    assert run("config", "check", "--strict", str(path)).returncode == 1
    complete = run("config", "check", str(path), env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": "admin-token-0123456789"})
    assert complete.returncode == 0 and complete.stderr == ""


def test_config_check_fails_as_serve_does_on_an_unset_api_key_env(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump({"pools": {"a": {
        "served_model": "m", "replicas": ["http://127.0.0.1:9"], "api_key_env": "VLLM_KEY"}}}))
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": "admin-token-0123456789"}
    result = run("config", "check", "--strict", str(path), env=env)
    assert result.returncode == 1
    assert "pools.a.api_key_env: the environment variable VLLM_KEY is not set" in result.stderr
    serve = run("serve", "--config", str(path), "--port", str(free_port()), env=env)
    assert serve.returncode != 0 and "VLLM_KEY is not set" in serve.stderr
    assert run("config", "check", str(path), env=env).returncode == 0
    assert run("config", "check", "--strict", str(path),
               env={**env, "VLLM_KEY": "k"}).returncode == 0


def test_config_check_fails_as_serve_does_on_a_short_salt_secret(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump(
        {"pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}))
    env = {"KVGATE_SALT_SECRET": "short", "KVGATE_ADMIN_TOKEN": "admin-token-0123456789"}
    result = run("config", "check", str(path), env=env)
    assert result.returncode == 0
    assert "the salt secret is shorter than 16 bytes" in result.stderr
    assert run("config", "check", "--strict", str(path), env=env).returncode == 1
    serve = run("serve", "--config", str(path), "--port", str(free_port()), env=env)
    assert serve.returncode != 0 and "at least 16 bytes" in serve.stderr


def test_config_check_of_the_example_passes_without_secrets() -> None:
    result = run("config", "check", "examples/kvgate.yaml")
    assert result.returncode == 0, result.stderr
    assert "warning" in result.stderr  # the missing secrets are still named


def test_no_auth_listens_on_loopback_and_says_where() -> None:
    port = free_port()
    gw = Proc([*KVGATE, "serve", "--no-auth", "--port", str(port), "--upstream",
               "http://127.0.0.1:9"], env={"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": ""},
              ready_url=f"http://127.0.0.1:{port}/healthz")
    with gw:
        gw.stop()
        assert f"listening on http://127.0.0.1:{port}" in gw.output()
        assert "127.0.0.1 only" in gw.output()


def test_the_pickers_listening_line_names_its_own_ports() -> None:
    """`kvgate epp` said `listening on http://127.0.0.1:8000` (server.port, which it never
    binds): its line names the gRPC port and the HTTP port it serves."""
    grpc, http = free_port(), free_port()
    picker = Proc([*KVGATE, "epp", "--no-auth", "--port", str(grpc), "--http-port", str(http),
                   "--upstream", "http://127.0.0.1:9"],
                  env={"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": ""},
                  ready_url=f"http://127.0.0.1:{http}/healthz")
    with picker:
        picker.stop()
        line = next(x for x in picker.output().splitlines() if "\"msg\":\"listening on" in x)
        assert f"grpc 127.0.0.1:{grpc}" in line and f"http://127.0.0.1:{http}" in line, line
        assert ":8000" not in line, line


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`kvgate config check | head -1` once head has exited: no BrokenPipeError traceback
    (the reading end is closed before the command writes, so the writer always meets it)."""
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump(
        {"pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}))
    proc = subprocess.Popen(
        [*KVGATE, "config", "check", str(path)], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env={"PATH": "/usr/bin:/bin", "KVGATE_CONFIG": "", "KVGATE_SALT_SECRET": AUTH_SECRET,
             "KVGATE_ADMIN_TOKEN": "admin-token-0123456789"})
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=30) == 1
    assert err == ""


def test_serve_on_a_port_in_use_is_one_line(busy_port: int) -> None:
    result = run("serve", "--no-auth", "--host", "127.0.0.1", "--port", str(busy_port),
                 "--upstream", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"kvgate serve: cannot listen on 127.0.0.1:{busy_port}: "
                     "address already in use (choose another port with --port)"]


def test_demo_on_a_port_in_use_says_to_use_port(busy_port: int) -> None:
    result = run("demo", "--port", str(busy_port))
    assert result.returncode == 1
    assert result.stderr.strip() == (f"kvgate demo: cannot listen on 127.0.0.1:{busy_port}: "
                                     "address already in use (choose another port with --port)")


def test_sim_on_a_port_in_use_is_one_line(busy_port: int) -> None:
    """Not uvicorn's `ERROR: [Errno 98] ...` and its exit status 3."""
    result = run("sim", "--host", "127.0.0.1", "--port", str(busy_port), "--model", "m")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"kvgate sim: cannot listen on 127.0.0.1:{busy_port}: "
                     "address already in use (choose another port with --port)"]
    assert result.stdout == ""


NOT_HERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never an address of this machine


@pytest.mark.parametrize("cmd", [("serve", "--no-auth", "--upstream", "http://127.0.0.1:9"),
                                 ("epp", "--no-auth", "--upstream", "http://127.0.0.1:9"),
                                 ("sim", "--model", "m")])
def test_a_host_not_of_this_machine_says_to_change_the_host(cmd: tuple[str, ...]) -> None:
    """Not "choose another port": no port would do."""
    port = str(free_port())
    result = run(*cmd, "--host", NOT_HERE, "--port", port)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvgate {cmd[0]}: cannot listen on {NOT_HERE}:{port}"), lines
    assert "--host" in lines[0] and "--port" not in lines[0], lines


def test_serve_with_its_admin_port_in_use_names_that_setting(busy_port: int) -> None:
    """`--port` moves the API port, not the admin port that is taken."""
    result = run("serve", "--no-auth", "--host", "127.0.0.1", "--port", str(free_port()),
                 "--upstream", "http://127.0.0.1:9",
                 env={"KVGATE_SERVER__ADMIN_PORT": str(busy_port)})
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"kvgate serve: cannot listen on 127.0.0.1:{busy_port}: address already in use "
        "(choose another admin port in server.admin_port or KVGATE_SERVER__ADMIN_PORT)"]


@pytest.mark.parametrize(("flag", "hint"), [
    ("--port", " (gRPC): address already in use (choose another gRPC port with --port (epp.port))"),
    ("--http-port", ": address already in use (choose another HTTP port with --http-port "
                    "(server.admin_port))")])
def test_epp_on_a_port_in_use_is_one_line_naming_the_flag(
        busy_port: int, flag: str, hint: str) -> None:
    """As `kvgate serve`'s: it said why, not what to change."""
    result = run("epp", "--no-auth", "--host", "127.0.0.1", flag, str(busy_port),
                 "--upstream", "http://127.0.0.1:9")
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"kvgate epp: cannot listen on 127.0.0.1:{busy_port}{hint}"]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_logs_have_no_colour_and_no_false_recovery(sim_factory: SimFactory, fmt: str) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim], auth=True, args=["--log-format", fmt],
                            env={"KVGATE_SALT_SECRET": AUTH_SECRET,
                                 "KVGATE_ADMIN_TOKEN": "admin-token-0123456789"})
    with gw:
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert gw.stop() == 0
        out = gw.output()
    assert "Started server process" in out and "Finished server process" in out
    assert not ANSI.search(out)
    assert "color_message" not in out
    assert "reachable again" not in out
    if fmt == "json":
        for line in out.splitlines():
            if line.startswith("{"):
                orjson.loads(line)


def test_no_false_recovery_at_a_normal_start_with_redis(sim_factory: SimFactory,
                                                        redis_url: str) -> None:
    """With Redis (tenancy store, shared limits, shared routing state) a normal start and
    traffic log no "reachable again" nor "answers again": nothing was ever unreachable."""
    _, sim = sim_factory("--time-scale", "50")
    admin_token = "admin-token-0123456789"
    gw, base = gateway_proc(upstreams=[sim], auth=True, args=["--log-level", "info"], env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": admin_token,
        "KVGATE_REDIS_URL": redis_url})
    with gw, admin_client(base, admin_token) as admin:
        ready = httpx.get(f"{base}/readyz").json()
        assert ready["tenancy"]["store"] == "redis" and not ready["degraded"], ready
        assert admin.post("/tenants", json={"id": "t", "tier": "default",
                                            "limits": {"rpm": 100}}).status_code == 201
        key = admin.post("/tenants/t/keys").json()["key"]
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
        for _ in range(3):
            assert c.completions.create(model="sim-model", prompt="x", max_tokens=2).choices
        time.sleep(1.5)  # a few refreshes of the tenancy state and reads of the routing stream
        assert gw.stop() == 0
        out = gw.output()
    assert "gateway started" in out and "shared routing state on (0 peers)" in out
    assert "reachable again" not in out and "unreachable" not in out
    assert "answers again" not in out and "cannot reach" not in out


def test_ratelimit_headers_on_every_answer_of_a_limited_tenant(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim], auth=True, env={
        "KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": "admin-token-0123456789"})
    with gw, admin_client(base, "admin-token-0123456789") as admin:
        keys = {}
        for tenant, limits in (("limited", {"rpm": 3}), ("free", {})):
            assert admin.post("/tenants", json={"id": tenant, "tier": "default",
                                                "limits": limits}).status_code == 201
            keys[tenant] = admin.post(f"/tenants/{tenant}/keys").json()["key"]
        c = openai.OpenAI(base_url=f"{base}/v1", api_key=keys["limited"], max_retries=0)
        seen = []
        ok = c.completions.with_raw_response.create(model="sim-model", prompt="x", max_tokens=2)
        seen.append(ok.headers)
        with c.completions.with_streaming_response.create(
                model="sim-model", prompt="x", max_tokens=2, stream=True) as stream:
            seen.append(stream.headers)
        with pytest.raises(openai.BadRequestError) as upstream_400:  # vLLM's own 400, relayed
            c.completions.create(model="sim-model", prompt="x", max_tokens=2, n=0)
        seen.append(upstream_400.value.response.headers)
        with pytest.raises(openai.RateLimitError) as limited:
            c.completions.create(model="sim-model", prompt="x", max_tokens=2)
        seen.append(limited.value.response.headers)
        assert [h.get("x-ratelimit-limit-requests") for h in seen] == ["3"] * 4
        assert [h.get("x-ratelimit-remaining-requests") for h in seen] == ["2", "1", "0", "0"]
        free = openai.OpenAI(base_url=f"{base}/v1", api_key=keys["free"], max_retries=0)
        raw = free.completions.with_raw_response.create(model="sim-model", prompt="x",
                                                        max_tokens=2)
        assert not [h for h in raw.headers if h.startswith("x-ratelimit")]


def test_kubernetes_discovery_outside_a_cluster_is_refused_before_listening(
    tmp_path: Path, busy_port: int
) -> None:
    """One line and status 2 before binding (the busy port would say otherwise), as for a
    missing secret; it was the lifespan's failure: uvicorn's log lines and status 3."""
    path = tmp_path / "k.yaml"
    path.write_text("pools:\n  a: {discovery: {kubernetes: {service: vllm}}}\n")
    result = run("serve", "--config", str(path), "--no-auth", "--port", str(busy_port))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "kvgate serve: pools.a.discovery.kubernetes.api_server: not set and "
        "KUBERNETES_SERVICE_HOST/PORT absent (outside a cluster, set it: e.g. "
        "http://127.0.0.1:8001 with `kubectl proxy`)"]


def test_config_errors_name_the_file(tmp_path: Path) -> None:
    bad_field = tmp_path / "bad-field.yaml"
    bad_field.write_text(yaml.safe_dump({
        "pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
        "upstream": {"idle_timeout_s": -1}}))
    bad_yaml = tmp_path / "bad-yaml.yaml"
    bad_yaml.write_text("pools:\n  a: [\n")
    for path, what in ((bad_field, "upstream.idle_timeout_s"), (bad_yaml, "line 3")):
        for cmd in (("config", "check", str(path)),
                    ("serve", "--config", str(path), "--no-auth", "--port", str(free_port()))):
            result = run(*cmd)
            assert result.returncode == 2, result.stderr
            assert str(path) in result.stderr and what in result.stderr, result.stderr
            assert "Traceback" not in result.stderr


def test_one_dead_pool_keeps_the_gateway_ready_and_says_which(sim_factory: SimFactory) -> None:
    """Two pools, one with no replica up: every gateway pod sees the same, so a 503 from
    /readyz took every pod out of the Service and the live pool's traffic with it."""
    _, sim = sim_factory("--time-scale", "50")
    dead = f"http://127.0.0.1:{free_port()}"
    config = {"pools": {"live": {"replicas": [sim]}, "gone": {"replicas": [dead]}}}
    gw, base = gateway_proc(config=config)
    with gw:
        ready = httpx.get(f"{base}/readyz")
        assert ready.status_code == 200, ready.text
        doc = ready.json()
        assert doc["status"] == "ready" and doc["degraded"] is True
        assert list(doc["not_ready"]) == ["gone"]
        models = httpx.get(f"{base}/v1/models").json()
        assert [p["pool"] for p in models["not_ready"]] == ["gone"]
    # no pool can serve: not ready
    gw, base = gateway_proc(config={"pools": {"gone": {"replicas": [dead]}}}, ready=False)
    with gw:
        doc = httpx.get(f"{base}/readyz")
        assert doc.status_code == 503
        assert doc.json()["not_ready"]["gone"].startswith(
            "served model not known yet (no replica answered)")
        # and why, once the health monitor tried it
        why = f"served model not known yet (no replica answered) ({dead[7:]}: /health: " \
              "cannot connect)"
        wait_for(lambda: httpx.get(f"{base}/readyz").json()["not_ready"] == {"gone": why},
                 what="the replica's down reason")
        # an API client is told the same without the replica's address (/readyz is the
        # operators' page; /v1/models and a request's 503 are any key holder's)
        models = httpx.get(f"{base}/v1/models").json()
        why = "served model not known yet (no replica answered) (1 replica: cannot connect)"
        assert models["not_ready"] == [{"pool": "gone", "reason": why}], models
        resp = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x"})
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["message"] == (
            "No ready replica for the model `m` (not ready: pool gone: no replica has answered "
            "yet; 1 replica: cannot connect).")
        assert dead[7:] not in resp.text
