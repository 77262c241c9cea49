"""A `KVGATE_REDIS_URL` whose database is not a number (``/db2``, ``/kvgate``): redis-py read
it as database 0 without a word, so two deployments meant for two databases shared one (their
tenants, keys and routes mixed). `kvgate serve` and `kvgate config check` now refuse it at
start, without showing the URL (it may hold a password)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.procs import KVGATE, ROOT, free_port

PASSWORD = "db-path-pass-Zr81"  # tests only


def _run(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVGATE_REDIS_URL": url, "KVGATE_CONFIG": "",
           "KVGATE_SALT_SECRET": "0123456789abcdef0123", "KVGATE_ADMIN_TOKEN": ""}
    return subprocess.run([*KVGATE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("path", ["/db2", "/kvgate", "/2x"])
def test_a_database_that_is_not_a_number_is_refused_at_start(path: str) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}{path}"
    served = _run("serve", "--host", "127.0.0.1", "--port", str(free_port()),
                  "--upstream", "http://127.0.0.1:9", url=url)
    assert served.returncode != 0
    out = served.stdout + served.stderr
    assert "KVGATE_REDIS_URL names its database by a path that is not a number" in out, out
    assert PASSWORD not in out and path not in out and "Traceback" not in out


def test_a_numbered_database_or_none_is_taken() -> None:
    for path in ("/3", "/", ""):
        # (no Redis there: the check is of the URL only, so `config check` passes)
        checked = _run("config", "check", "--strict", url=f"redis://127.0.0.1:1{path}")
        assert "KVGATE_REDIS_URL" not in checked.stdout + checked.stderr, checked
