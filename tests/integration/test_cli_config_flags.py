"""The real `kvgate` command with a flag that sets a configuration key given a bad value: one
usage line naming the flag, exit 2, no traceback, nothing started. `kvgate demo --port 70000`
said the error was in ``server.port`` (a key the demo's user never wrote), as `kvgate serve`
and `kvgate epp` did for their ports, `--workers`, `--log-level`, `--policy`, `--fallbacks`."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.procs import KVGATE, ROOT

QUICK = ["--no-auth", "--upstream", "http://127.0.0.1:9"]
CHOICES = "(choose from 'debug', 'info', 'warning', 'error', 'critical')"
POLICIES = "(choose from 'cache_aware', 'consistent_hash', 'least_load', 'round_robin')"


@pytest.mark.parametrize(("argv", "said"), [
    (["demo", "--port", "70000"], "argument --port: '70000': expected a whole number from 0 "
     "to 65535"),
    (["demo", "--port", "-1"], "argument --port: '-1': expected a whole number from 0 to 65535"),
    (["serve", *QUICK, "--port", "70000"], "argument --port: '70000': expected a whole number "
     "from 0 to 65535"),
    (["serve", *QUICK, "--workers", "0"], "argument --workers: '0': expected a whole number "
     "from 1 to 64"),
    (["serve", *QUICK, "--workers", "65"], "argument --workers: '65': expected a whole number "
     "from 1 to 64"),
    (["serve", *QUICK, "--log-level", "loud"], f"argument --log-level: invalid choice: 'loud' "
     f"{CHOICES}"),
    (["serve", *QUICK, "--policy", "fastest"], f"argument --policy: invalid choice: 'fastest' "
     f"{POLICIES}"),
    (["epp", *QUICK, "--port", "70000"], "argument --port: '70000': expected a whole number "
     "from 0 to 65535"),
    (["epp", *QUICK, "--http-port", "0"], "argument --http-port: '0': expected a whole number "
     "from 1 to 65535"),
    (["epp", *QUICK, "--fallbacks", "10"], "argument --fallbacks: '10': expected a whole "
     "number from 0 to 9"),
    (["epp", *QUICK, "--log-level", "loud"], f"argument --log-level: invalid choice: 'loud' "
     f"{CHOICES}"),
    (["epp", *QUICK, "--policy", "fastest"], f"argument --policy: invalid choice: 'fastest' "
     f"{POLICIES}"),
])
def test_a_bad_flag_value_is_named_as_the_flag(argv: list[str], said: str) -> None:
    result = subprocess.run([*KVGATE, *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1] == f"kvgate {argv[0]}: error: {said}"
    assert "Traceback" not in result.stderr and "server." not in result.stderr

