"""`kvgate config check` run as a new user first types it: without a file."""

from __future__ import annotations

import subprocess
from pathlib import Path

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


def test_serve_without_a_file_says_to_give_one() -> None:
    """Not "pools: at least one pool is required" alone: a new user has no file yet."""
    result = subprocess.run([*KVGATE, "serve"], cwd=ROOT, capture_output=True, text=True,
                            timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2
    assert result.stderr == ("kvgate serve: pools: at least one pool is required: no "
                             "configuration file given (--config FILE, or set KVGATE_CONFIG), "
                             "or use --upstream URL\n")


def test_a_file_without_pools_is_named(tmp_path: Path) -> None:
    path = tmp_path / "k.yaml"
    path.write_text("server: {port: 8000}\n")
    for cmd, line in ((["serve", "--config", str(path)],
                       f"kvgate serve: pools: at least one pool is required in {path} (or use "
                       "--upstream URL)\n"),
                      (["config", "check", str(path)],
                       f"kvgate config: pools: at least one pool is required in {path}\n")):
        result = subprocess.run([*KVGATE, *cmd], cwd=ROOT, capture_output=True, text=True,
                                timeout=30, env={"PATH": "/usr/bin:/bin"})
        assert (result.returncode, result.stderr) == (2, line)
