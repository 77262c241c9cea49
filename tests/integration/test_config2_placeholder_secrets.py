"""deploy/examples/secrets.example.yaml applied unedited: `kvgate serve` refuses its
placeholder admin token and salt secret at start, naming the variable (it served with them: an
admin token anyone can read in the repository, so anyone reaching the gateway could create
API keys), and a random value starts as before."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.procs import KVGATE, free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "secrets.example.yaml"
RANDOM = {"KVGATE_ADMIN_TOKEN": "a3f1c9e27b4d8e6f0a1b2c3d4e5f6a7b",
          "KVGATE_SALT_SECRET": "9c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f"}


def _example() -> dict[str, str]:
    (secret, *_) = [d for d in yaml.safe_load_all(EXAMPLE.read_text())
                    if d["metadata"]["name"] == "kvgate-secrets"]
    data = secret["stringData"]
    return {"KVGATE_ADMIN_TOKEN": data["admin-token"], "KVGATE_SALT_SECRET": data["salt-secret"]}


def _serve(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [*KVGATE, "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--upstream", f"http://127.0.0.1:{free_port()}", *args]
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}, **env}
    return subprocess.run(cmd, env=full, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("variable", ["KVGATE_ADMIN_TOKEN", "KVGATE_SALT_SECRET"])
def test_the_examples_placeholder_is_refused_at_start(variable: str) -> None:
    env = {**RANDOM, variable: _example()[variable]}
    done = _serve(env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{variable} is the example's placeholder" in done.stderr
    assert "listening on" not in done.stderr


def test_a_random_secret_still_passes_the_check() -> None:
    # the config check alone: `kvgate serve` would start; --workers 2 without Redis stops it
    # right after the secrets are judged, with that reason and not theirs
    done = _serve(RANDOM, "--workers", "2")
    assert done.returncode != 0
    assert "placeholder" not in done.stderr
    assert "KVGATE_REDIS_URL" in done.stderr
