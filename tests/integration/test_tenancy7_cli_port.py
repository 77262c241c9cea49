"""`kvgate serve --port N` over a file whose `server.port` is not valid: the flag wins (the
documented precedence), so the gateway starts on N, and says once that the file's value is
invalid and unused (it started without a word, and failed the day the flag was dropped).
Without the flag the start fails naming the field and what the file held."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable

import httpx
import yaml

from tests.support.gateway import gateway_proc
from tests.support.procs import KVGATE, Proc

SimFactory = Callable[..., tuple[Proc, str]]


def test_a_bad_port_in_the_file_under_the_port_flag(sim_factory: SimFactory) -> None:
    _, sim = sim_factory(model="m")
    config = {"server": {"port": 99999}, "pools": {"p": {"replicas": [sim]}}}
    gw, base = gateway_proc(config=config)  # (it gives --port)
    with gw:
        assert httpx.get(f"{base}/healthz").status_code == 200
        out = gw.output()
        assert ("warning: server.port: Input should be less than or equal to 65535 (got "
                "99999); not used: --port overrides it") in out, out
        assert out.count("server.port") == 1, out

    fd, path = tempfile.mkstemp(prefix="kvgate-test-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(config, f)
        env = {**os.environ, "KVGATE_CONFIG": "", "KVGATE_REDIS_URL": ""}
        done = subprocess.run([*KVGATE, "serve", "--no-auth", "--config", path], env=env,
                              capture_output=True, text=True, timeout=60, check=False)
    finally:
        os.unlink(path)
    assert done.returncode == 2, done.stderr
    assert "server.port: Input should be less than or equal to 65535 (got 99999)" in (
        done.stderr), done.stderr
    assert "Traceback" not in done.stderr
