"""The real `kvgate` commands given a replica at the gateway's own address: `kvgate serve
--port P --upstream http://127.0.0.1:P` started, passed its own health checks (kvgate answers
vLLM's /health) and sent each request back to itself, hop after hop, until the client gave up.
Now serve and epp refuse to start with one line naming the replica and the setting, and
`kvgate config check` says so (an error with --strict for serve's ports). And `kvgate epp`
without a salt secret is told its own flag."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.procs import KVGATE, ROOT, free_port

ENV = {**os.environ, "KVGATE_SALT_SECRET": "s" * 32, "KVGATE_ADMIN_TOKEN": "t" * 32}


def kvgate(*argv: str) -> subprocess.CompletedProcess[str]:
    """The command's outcome; one still running after 30 s (a gateway that started) is
    killed and fails the test."""
    return subprocess.run([*KVGATE, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=30, env=ENV)


def test_serve_refuses_a_replica_at_its_own_port() -> None:
    port = free_port()
    result = kvgate("serve", "--no-auth", "--port", str(port),
                    "--upstream", f"http://localhost:{port}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"kvgate serve: pools.default: the replica http://localhost:{port} is this gateway's "
        f"own address (server.port {port}): its requests would come back to kvgate; list the "
        "vLLM server's address, or listen on another port")
    assert "listening on" not in result.stderr and "Traceback" not in result.stderr


def test_epp_refuses_a_replica_at_its_grpc_port(tmp_path: Path) -> None:
    grpc, http = free_port(), free_port()
    path = tmp_path / "kvgate.yaml"
    path.write_text(f"epp: {{port: {grpc}}}\nserver: {{admin_port: {http}}}\n"
                    f"pools:\n  a: {{served_model: m, replicas: ['http://127.0.0.1:{grpc}']}}\n")
    result = kvgate("epp", "--config", str(path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        f"kvgate epp: pools.a: the replica http://127.0.0.1:{grpc} is this gateway's own "
        f"address (epp.port {grpc})")


def test_config_check_names_it_and_strict_fails_for_serve(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("server: {port: 8000}\n"
                    "pools:\n  a: {served_model: m, replicas: ['http://127.0.0.1:8000']}\n")
    plain, strict = kvgate("config", "check", str(path)), kvgate("config", "check", "--strict",
                                                                  str(path))
    assert plain.returncode == 0 and strict.returncode == 1, strict.stderr
    assert ("kvgate config: error: pools.a: the replica http://127.0.0.1:8000 is this "
            "gateway's own address (server.port 8000)") in strict.stderr
    assert "`kvgate serve` will refuse to start" in strict.stderr


def test_epp_without_a_salt_secret_names_its_own_flag() -> None:
    """`kvgate epp` without a salt secret said to run `kvgate serve --no-auth`, another
    command (the picker takes --no-auth itself)."""
    env = {k: v for k, v in ENV.items() if k != "KVGATE_SALT_SECRET"}
    result = subprocess.run([*KVGATE, "epp", "--upstream", "http://127.0.0.1:9"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 2, result.stderr
    line = result.stderr.splitlines()[-1]
    assert line.startswith("kvgate epp: authentication is on but no salt secret is configured")
    assert line.endswith("or run with --no-auth for local single-tenant use")
    assert "kvgate serve" not in line
