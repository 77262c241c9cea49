"""An admin token no HTTP header can carry (a non-ASCII letter, a blank, a control character).

`kvgate serve` started with one, and every admin call was a 401 (curl sends its UTF-8 bytes)
or, from `kvgate admin`, a traceback (httpx refuses the header). Now the gateway refuses it at
start (exit 2, one message naming the variable, the token not shown) and `kvgate admin`
says the same in one line, exit 2, as `kvgate doctor` did."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.procs import KVGATE, ROOT, free_port

BAD = ["tökenops8admintoken0123456789", "ops8 admin token 0123456789", "ops8admin\ttoken0123456789"]


def _env(token: str) -> dict[str, str]:
    return {**os.environ, "KVGATE_ADMIN_TOKEN": token, "KVGATE_CONFIG": "",
            "KVGATE_REDIS_URL": "", "KVGATE_SALT_SECRET": "ops8-salt-secret-0123456789abcdef"}


@pytest.mark.parametrize("token", BAD, ids=["non-ascii", "blank", "tab"])
def test_serve_refuses_it_at_start(token: str) -> None:
    done = subprocess.run(
        [*KVGATE, "serve", "--host", "127.0.0.1", "--port", str(free_port()),
         "--upstream", "http://127.0.0.1:9"],
        env=_env(token), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "KVGATE_ADMIN_TOKEN: the admin token holds a space, a control or a non-ASCII " \
        "character" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and token not in done.stderr + done.stdout


@pytest.mark.parametrize("token", BAD, ids=["non-ascii", "blank", "tab"])
def test_the_admin_cli_says_so_in_one_line(token: str) -> None:
    done = subprocess.run(
        [*KVGATE, "admin", "--url", f"http://127.0.0.1:{free_port()}", "tenants", "list"],
        env=_env(token), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "an HTTP header cannot carry it" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and token not in done.stderr
