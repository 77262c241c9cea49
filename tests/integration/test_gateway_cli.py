"""`kvgate serve` with a config file, start-up errors, `kvgate config check`, `kvgate demo`."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import KVGATE, ROOT, Proc, free_port

SimFactory = Callable[..., tuple[Proc, str]]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVGATE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=30, env=env)


def test_full_form_config_maps_public_names_to_pools(sim_factory: SimFactory) -> None:
    _, fp8 = sim_factory("--time-scale", "50", model="served-fp8")
    _, awq = sim_factory("--time-scale", "50", model="served-awq", )
    config = {
        "pools": {"fp8": {"served_model": "served-fp8", "replicas": [fp8]},
                  "awq": {"served_model": "served-awq", "replicas": [awq]}},
        "models": {"llama": {"default": "fp8", "free": "awq"}, "small": {"default": "awq"}},
        "tiers": {"free": {"priority": 10}},
        "server": {"route_header": False},
    }
    gw, base = gateway_proc(config=config)
    with gw:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        assert sorted(m.id for m in c.models.list()) == ["llama", "small"]
        raw = c.completions.with_raw_response.create(model="small", prompt="x", max_tokens=1)
        assert raw.parse().model == "served-awq"
        assert raw.headers["x-kvgate-replica"].startswith("awq/")
        assert "x-kvgate-route" not in raw.headers
        raw = c.completions.with_raw_response.create(model="llama", prompt="x", max_tokens=1)
        assert raw.headers["x-kvgate-replica"].startswith("fp8/")


def test_invalid_config_fails_at_start_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({
        "pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
        "upstream": {"idle_timeout_s": -1},
    }))
    result = run("serve", "--config", str(path), "--port", str(free_port()))
    assert result.returncode == 2
    assert "upstream.idle_timeout_s" in result.stderr
    assert "Traceback" not in result.stderr


def test_config_check_prints_effective_config_without_secrets(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump({
        "pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}))
    env = {"KVGATE_SERVER__PORT": "9123", "KVGATE_ADMIN_TOKEN": "very-secret-token",
           "KVGATE_SALT_SECRET": "very-secret-salt-0123", "PATH": "/usr/bin:/bin"}
    result = run("config", "check", str(path), env=env)
    assert result.returncode == 0, result.stderr
    effective = yaml.safe_load(result.stdout)
    assert effective["server"]["port"] == 9123
    assert effective["upstream"]["connect_timeout_s"] == 3.0
    assert "very-secret-token" not in result.stdout
    assert "very-secret-salt" not in result.stdout
    assert run("config", "check", str(tmp_path / "missing.yaml")).returncode == 2


def test_demo_serves_and_stops_cleanly() -> None:
    """The banner is printed once the demo serves (no polling thread): the test waits for the
    banner itself, pastes the printed Python snippet into a shell as a user would, then
    stops the demo with Ctrl-C (exit 0)."""
    port = free_port()
    demo = Proc([*KVGATE, "demo", "--port", str(port), "--time-scale", "50"], timeout=60)
    with demo:
        wait_for(lambda: "Ctrl-C stops everything." in demo.output(), timeout=60,
                 what="the demo's banner")
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/readyz").status_code == 200  # serving once the banner is out
        out = demo.output()
        snippet = re.search(r"^\S+ - <<'EOF'\n.*?^EOF$", out, re.S | re.M)
        assert snippet, out
        pasted = subprocess.run(["bash", "-c", snippet.group(0)], capture_output=True,
                                text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
        assert pasted.returncode == 0, pasted.stderr
        replies = pasted.stdout.splitlines()
        assert [r.split()[:2] for r in replies] == [
            [replies[0].split()[0], "demo-8b-fp8"], [replies[1].split()[0], "demo-70b-awq"]]
        assert replies[0].startswith("fp8/") and replies[1].startswith("awq/")
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="demo", max_retries=0)
        reply = c.chat.completions.create(
            model="kvgate-demo", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4)
        assert reply.model == "demo-8b-fp8"  # the default tier goes to the fp8 pool
        # the Responses API's follow-ups, as the README shows them (the replicas store)
        first = c.responses.create(model="kvgate-demo", input="Hello!", max_output_tokens=4)
        assert c.responses.retrieve(first.id).id == first.id
        again = c.responses.create(model="kvgate-demo", input="And?", max_output_tokens=4,
                                   previous_response_id=first.id)
        assert again.previous_response_id == first.id and again.output_text
        demo.signal(signal.SIGINT)
        assert demo.popen is not None and demo.popen.wait(20) == 0
        assert "kvgate demo: stopped" in demo.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base}/healthz", timeout=1)


@pytest.mark.parametrize(("tenants", "field", "why"), [
    ([{"id": "acme", "tier": "platinum"}], "tenants.0.tier", "unknown tier 'platinum'"),
    ([{"id": "acme"}, {"id": "acme", "tier": "free"}], "tenants.1.id", "listed twice"),
    ([{"id": "acme corp/1"}], "tenants.0.id", "is not a name"),
    ([{"id": "acme", "salt_group": "g 1"}], "tenants.0.salt_group", "is not a name"),
])
def test_bad_bootstrap_tenant_is_refused_naming_the_field(
    tmp_path: Path, tenants: list[dict[str, str]], field: str, why: str
) -> None:
    # the admin API refuses each of these; from the config they used to start a gateway whose
    # tenant was never admitted (403), drop a duplicate silently, or crash in the lifespan
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({
        "pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
        "tiers": {"free": {"priority": 10}},
        "tenants": tenants,
    }))
    env = {"PATH": "/usr/bin:/bin", "KVGATE_SALT_SECRET": "e2e-salt-secret-0123456789abcdef"}
    result = run("serve", "--config", str(path), "--port", str(free_port()), env=env)
    assert result.returncode == 2, result.stderr
    assert f"{field}: " in result.stderr and why in result.stderr
    assert "Traceback" not in result.stderr and "listening" not in result.stderr
    assert run("config", "check", str(path), env=env).returncode == 2


def test_a_replica_in_two_pools_is_refused(tmp_path: Path, sim_factory: SimFactory) -> None:
    # replicas are keyed by host:port: one listed in two pools was scraped for one of them
    # only, and the other pool routed on its stale (ignored) load without a word
    _, sim = sim_factory("--time-scale", "50", model="m")
    pools = {"a": {"served_model": "m", "replicas": [sim]},
             "b": {"served_model": "m", "replicas": [f"{sim}/"]}}
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump({"pools": pools}))
    result = run("config", "check", str(path))
    assert result.returncode == 2, result.stderr
    assert "pools.b.replicas: " in result.stderr and "also a replica of pool 'a'" in result.stderr
    assert "Traceback" not in result.stderr
    token = "two-pools-admin-token-0123456789"
    env = {"KVGATE_SALT_SECRET": "e2e-salt-secret-0123456789abcdef", "KVGATE_ADMIN_TOKEN": token}
    gw, base = gateway_proc(config={"pools": {"a": pools["a"]}}, env=env, auth=True)
    with gw:
        headers = {"Authorization": f"Bearer {token}"}
        doc = httpx.get(f"{base}/admin/policy", headers=headers, timeout=10).json()
        doc["pools"]["b"] = pools["b"]
        put = httpx.put(f"{base}/admin/policy", headers=headers, json=doc, timeout=10)
        assert put.status_code == 400, put.text
        assert "pools.b.replicas" in put.json()["error"]["message"]


@pytest.mark.parametrize("url", ["redis://127.0.0.1:notaport/0", "redis://:pa/ss@h:6379/0",
                                 "redis://127.0.0.1:6379/0?socket_timeout=abc"])
def test_a_malformed_redis_url_is_refused_at_load_naming_the_variable(
    tmp_path: Path, url: str
) -> None:
    # it used to pass the config check, print "listening on", then fail in the lifespan with
    # redis-py's "Port could not be cast to integer value as 'pa'" (a piece of the password)
    path = tmp_path / "k.yaml"
    path.write_text(yaml.safe_dump({
        "pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}))
    env = {"PATH": "/usr/bin:/bin", "KVGATE_SALT_SECRET": "e2e-salt-secret-0123456789abcdef",
           "KVGATE_REDIS_URL": url}
    serve = ["serve", "--port", str(free_port()), "--config", str(path)]
    for args in (serve, ["config", "check", str(path)]):
        result = run(*args, env=env)
        assert result.returncode == 2, result.stderr
        assert "KVGATE_REDIS_URL is not a valid Redis URL" in result.stderr
        assert "Traceback" not in result.stderr and "listening" not in result.stderr
        assert "pa/ss" not in result.stderr and "'pa'" not in result.stderr
        assert "percent-encode '/'" in result.stderr  # what to do about it
