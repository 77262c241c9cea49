"""`server.workers` > 1 with `sync.enabled: false`: each worker routes on its own state, so
the turns of one conversation land on whichever replica the worker its connection reached
picked (seen: 8 conversations of 5 turns through 2 workers on 3 replicas, every one moved
between replicas; 8 of 8 stayed on one with the shared state on). Nothing said so: `kvgate
serve` and `kvgate config check` now warn (it still starts: sharing is the operator's call)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

import pytest
import yaml

from tests.support.gateway import gateway_proc
from tests.support.procs import ROOT, Proc

pytestmark = pytest.mark.slow

MODEL = "sim-model"
SAID = "each worker routes on its own state"


def _config(sim: str, sync: bool) -> dict[str, object]:
    return {"pools": {"p": {"replicas": [sim], "served_model": MODEL}},
            "models": {MODEL: {"default": "p"}}, "server": {"workers": 2},
            "sync": {"enabled": sync}}


def test_serve_says_the_workers_route_apart_without_shared_state(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, sim = sim_factory()
    for sync in (False, True):
        gw, _ = gateway_proc(config=_config(sim, sync), env={"KVGATE_REDIS_URL": redis_url})
        with gw:
            said = gw.output(tail=None)
        assert (SAID in said) is not sync, said
        assert "Traceback" not in said


def test_config_check_says_it_too() -> None:
    fd, path = tempfile.mkstemp(prefix="kvgate-test-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(_config("http://127.0.0.1:9", False), f)
        env = {**os.environ, "KVGATE_REDIS_URL": "redis://127.0.0.1:9/0", "KVGATE_CONFIG": ""}
        done = subprocess.run([sys.executable, "-m", "gateway.cli", "config", "check", path,
                               "--strict"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
    finally:
        os.unlink(path)
    assert f"kvgate config: warning: server.workers 2 with sync.enabled false: {SAID}" in \
        done.stderr, done.stderr
