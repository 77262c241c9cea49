"""The base's Redis, started as its manifest starts it (a real redis-server with the
container's arguments), is the Redis docs/several-gateways.md asks for: `noeviction` with a
`maxmemory` above the routes stream's budget and below the container's memory limit. With
no `maxmemory` (Redis's default: unbounded) `noeviction` never applies: a Redis that fills
its container is OOM-killed, not refusing writes as kvgate expects (`OOM`, nothing lost)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import redis

from gateway.config import load_config
from tests.deploy.test_manifests import built, find
from tests.support.procs import Proc, free_port

UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
POOLS = {"pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}}


def _container() -> dict[str, Any]:
    spec = find(built("base"), "Deployment", "kvgate-redis")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert isinstance(container, dict)
    return container


def _bytes(quantity: str) -> int:
    return int(quantity[:-2]) * UNITS[quantity[-2:]]


@pytest.fixture()
def manifest_redis(tmp_path: Path) -> Any:
    exe = shutil.which("redis-server")
    assert exe is not None, "redis-server is not installed; run scripts/setup"
    args = [str(a) for a in _container()["args"]]
    args[args.index("--dir") + 1] = str(tmp_path)  # the volume's place here
    port = free_port()
    with Proc([exe, *args, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
              ready_port=port):
        client = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
        try:
            yield client
        finally:
            client.close()


def test_the_manifests_redis_refuses_writes_when_full_below_its_limit(
    manifest_redis: redis.Redis,
) -> None:
    config = manifest_redis.config_get("maxmemory*")
    assert config["maxmemory-policy"] == "noeviction"
    maxmemory = int(str(config["maxmemory"]))
    stream_budget = load_config(None, overrides=POOLS, environ={}).sync.stream_max_mb * 2**20
    assert maxmemory > stream_budget
    limit = _bytes(_container()["resources"]["limits"]["memory"])
    # room left for an append-only file rewrite's fork and the client buffers
    assert maxmemory <= limit * 3 // 4
