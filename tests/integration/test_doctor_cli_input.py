"""`kvgate doctor`'s input that no gateway can be asked with: one line on stderr, exit 2,
before any connection (each URL here has nothing listening, so a connection attempt would
be exit 1 instead).

Seen red-teaming the CLI: ``--timeout 1e308`` printed a traceback from its timer thread (a
socket refuses such a timeout); an admin token holding a newline said "cannot reach URL:
Illegal header value" (exit 1, as if the gateway were down); a ``--url`` with
``user:password@`` sent those as Basic auth in place of the admin token and the gateway
answered "missing admin token".
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from loadtest.fleet import free_port
from tests.support.procs import ROOT

TOKEN = "doctor-cli-input-admin-token-0123"


def _cli(*args: str, token: str = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "KVGATE_ADMIN_TOKEN": token}
    return subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("flags", "token", "said"), [
    (["--timeout", "1e308"], TOKEN, "--timeout must be positive and finite, at most 86400"),
    (["--timeout", "86401"], TOKEN, "--timeout must be positive and finite, at most 86400"),
    ([], "tok\nen-0123456789", "an HTTP header cannot carry it"),
    (["--admin-token", "tök-0123456789"], TOKEN, "an HTTP header cannot carry it"),
    (["--url", "http://ops:secret@127.0.0.1:{port}"], TOKEN, "no user:password@"),
])
def test_input_no_gateway_can_be_asked_with_is_one_line_and_exit_2(
    flags: list[str], token: str, said: str
) -> None:
    port = free_port()  # nothing listens there: a connection attempt would exit 1
    flags = [f.format(port=port) for f in flags]
    url = [] if "--url" in flags else ["--url", f"http://127.0.0.1:{port}"]
    done = _cli(*url, *flags, token=token)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "secret" not in done.stderr
    assert done.stdout == ""


def test_a_timeout_of_a_day_is_still_taken() -> None:
    done = _cli("--url", f"http://127.0.0.1:{free_port()}", "--timeout", "86400")
    assert done.returncode == 1 and "cannot reach" in done.stderr, done.stderr
