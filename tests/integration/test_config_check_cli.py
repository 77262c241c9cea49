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
