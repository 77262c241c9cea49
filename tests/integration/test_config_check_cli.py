"""`kvgate config check` run as a new user first types it: without a file."""

from __future__ import annotations

import subprocess

from tests.support.procs import KVGATE, ROOT


def test_config_check_without_a_file_says_to_give_one() -> None:
    result = subprocess.run([*KVGATE, "config", "check"], cwd=ROOT, capture_output=True,
                            text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert result.stderr == ("kvgate config: pools: at least one pool is required: no "
                             "configuration file given (`kvgate config check FILE`, or set "
                             "KVGATE_CONFIG)\n")


def test_a_bad_variable_without_a_file_is_not_blamed_on_the_missing_file() -> None:
    """The variable's error alone: the missing file is said once that is fixed."""
    result = subprocess.run([*KVGATE, "config", "check"], cwd=ROOT, capture_output=True,
                            text=True, timeout=30,
                            env={"PATH": "/usr/bin:/bin", "KVGATE_SERVER__PORT": "abc"})
    assert result.returncode == 2
    assert "server.port:" in result.stderr and "(from KVGATE_SERVER__PORT)" in result.stderr
    assert "no configuration file given" not in result.stderr, result.stderr
