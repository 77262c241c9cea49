"""A salt secret too short: `kvgate serve` said "must be at least 16 bytes" and nothing of how
to make one (the admin token's message names `openssl rand`). A real `kvgate serve`: exit
status 2, one message with the way out, no traceback, the secret not echoed."""

from __future__ import annotations

import os
import subprocess

from tests.support.procs import KVGATE, ROOT, free_port

SHORT = "tooshort-ops5"


def test_a_short_salt_secret_says_how_to_make_one() -> None:
    env = {**os.environ, "KVGATE_SALT_SECRET": SHORT, "KVGATE_CONFIG": "",
           "KVGATE_REDIS_URL": "", "KVGATE_ADMIN_TOKEN": "ops5-short-secret-admin-token-0123"}
    done = subprocess.run(
        [*KVGATE, "serve", "--host", "127.0.0.1", "--port", str(free_port()),
         "--upstream", "http://127.0.0.1:9"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "KVGATE_SALT_SECRET must be at least 16 bytes; it has 13" in done.stderr
    assert "openssl rand -hex 32" in done.stderr
    assert "Traceback" not in done.stderr and SHORT not in done.stderr + done.stdout
