"""deploy/examples/secrets.example.yaml's second Secret (vllm-api-keys) applied unedited: the
pools' `api_key_env` variables hold its placeholder (REPLACE-...). 9ace099 refused the
placeholder admin token and salt secret at start but not these: kvgate served, sending the
key anyone can read in the repository to the replicas (started with it as their --api-key).
Refused at start now, naming the pool and the variable; a random key starts as before."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from tests.support.procs import KVGATE, free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "examples" / "secrets.example.yaml"
SECRETS = {"KVGATE_ADMIN_TOKEN": "a3f1c9e27b4d8e6f0a1b2c3d4e5f6a7b",
           "KVGATE_SALT_SECRET": "9c8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f"}


def _placeholder() -> str:
    (keys,) = [d for d in yaml.safe_load_all(EXAMPLE.read_text())
               if d["metadata"]["name"] == "vllm-api-keys"]
    return str(keys["stringData"]["fp8"])


def _serve(tmp_path: Path, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "kvgate.yaml"
    config.write_text(yaml.safe_dump({"pools": {"fp8": {
        "served_model": "m", "replicas": [f"http://127.0.0.1:{free_port()}"],
        "api_key_env": "VLLM_FP8_KEY"}}}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")},
           **SECRETS, "KVGATE_CONFIG": str(config), "VLLM_FP8_KEY": key}
    cmd = [*KVGATE, "serve", "--host", "127.0.0.1", "--port", str(free_port()), *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_the_examples_replica_key_is_refused_at_start(tmp_path: Path) -> None:
    done = _serve(tmp_path, _placeholder())
    assert done.returncode == 2, done.stderr[-2000:]
    assert "VLLM_FP8_KEY is the example's placeholder" in done.stderr, done.stderr[-2000:]
    assert "pools.fp8" in done.stderr
    assert "listening on" not in done.stderr


def test_a_random_replica_key_passes_the_check(tmp_path: Path) -> None:
    # --workers 2 without Redis stops it right after the config is judged, with that reason
    done = _serve(tmp_path, "0f1e2d3c4b5a69788796a5b4c3d2e1f0", "--workers", "2")
    assert done.returncode != 0
    assert "placeholder" not in done.stderr
    assert "KVGATE_REDIS_URL" in done.stderr, done.stderr[-2000:]
