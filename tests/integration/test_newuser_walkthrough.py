"""A new user's first hour, the commands as a user types them: the simulator started as a
module (`python -m loadtest.sim`), and a config value of the wrong type, which named what the
field wanted but not what the file held (`rpm: "60"` was "should be a valid integer")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import KVGATE, ROOT

ENV = {**os.environ, "KVGATE_SALT_SECRET": "s" * 32, "KVGATE_ADMIN_TOKEN": "t" * 32}
POOLS = "pools:\n  a: {served_model: m, replicas: ['http://127.0.0.1:9']}\n"


def test_the_simulator_runs_as_a_module() -> None:
    """`python -m loadtest.sim` was "No module named loadtest.sim.__main__"."""
    result = subprocess.run([sys.executable, "-m", "loadtest.sim", "--port", "0", "--model"],
                            cwd=ROOT, capture_output=True, text=True, timeout=30, env=ENV)
    assert result.returncode == 2
    assert "argument --model: expected one argument" in result.stderr
    assert "Traceback" not in result.stderr
    help_text = subprocess.run([sys.executable, "-m", "loadtest.sim", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30, env=ENV)
    assert help_text.returncode == 0 and "--model MODEL" in help_text.stdout


@pytest.mark.parametrize(("text", "line"), [
    # the policy sections take YAML numbers only: "60" looks like one
    (f"{POOLS}tiers:\n  default: {{limits: {{rpm: '60'}}}}\n",
     "tiers.default.limits.rpm: Input should be a valid integer (got the string '60': write "
     "the number without quotes)"),
    (f"{POOLS}server:\n  port: abc\n",
     "server.port: Input should be a valid integer, unable to parse string as an integer "
     "(got 'abc')"),
    (f"{POOLS}server:\n  port: 80.5\n",
     "server.port: Input should be a valid integer, got a number with a fractional part "
     "(got 80.5)"),
    (f"{POOLS}routing:\n  load_factor: soon\n",
     "routing.load_factor: Input should be a valid number, unable to parse string as a number "
     "(got 'soon')"),
], ids=["quoted-number", "word-for-int", "fraction-for-int", "word-for-float"])
def test_a_value_of_the_wrong_type_is_named_with_what_the_file_held(
        tmp_path: Path, text: str, line: str) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(text)
    result = subprocess.run([*KVGATE, "config", "check", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=30, env=ENV)
    assert result.returncode == 2, result.stderr
    assert line in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("argv", "line"), [
    (["serve", "--prot", "9000"],
     "kvgate serve: error: unrecognized arguments: --prot 9000 (did you mean --port?)"),
    (["config", "check", "--stict", "kvgate.yaml"],
     "kvgate config: error: unrecognized arguments: --stict (did you mean --strict?)"),
    (["demo", "--prot", "1"],
     "kvgate demo: error: unrecognized arguments: --prot 1 (did you mean --port?)"),
    # (the admin CLI's errors leave out what follows `=`: it may be a token)
    (["admin", "tenants", "create", "acme", "--teir=free"],
     "kvgate admin: error: unrecognized arguments: --teir=... (did you mean --tier?)"),
], ids=["serve", "config-check", "demo", "admin"])
def test_a_misspelt_flag_names_the_flag_meant(argv: list[str], line: str) -> None:
    """argparse said "unrecognized arguments: --prot 9000" and no more; nothing starts."""
    result = subprocess.run([*KVGATE, *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=30, env=ENV)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == line
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("text", "line"), [
    # no space after the colon: read as the string "port:9000"; pydantic named its class
    ("server:\n  port:9000\n",
     "server: Input should be a mapping (got 'port:9000'): a key is followed by a colon and a "
     "space (`port: 9000`)"),
    (f"{POOLS}routing: 3\n", "routing: Input should be a mapping (got 3)"),
    # a line out of step with the ones above: PyYAML's parser terms only
    ("server:\n    host: 127.0.0.1\n  port: 9000\n",
     "expected <block end>, but found '<block mapping start>' at line 3, column 3 (while "
     "parsing a block mapping at line 1, column 1): the line is indented differently from the "
     "lines above it"),
    ("server:\n  host: 127.0.0.1\n   port: 9000\n",
     "mapping values are not allowed here at line 3, column 8: a `key: value` where a value "
     "goes (a line indented deeper than the one above it, or `: ` in a value: quote the value)"),
], ids=["no-space-after-colon", "number-for-section", "indent-out", "indent-in"])
def test_a_section_written_wrong_is_named_in_the_files_terms(
        tmp_path: Path, text: str, line: str) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(text)
    result = subprocess.run([*KVGATE, "config", "check", str(path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=30, env=ENV)
    assert result.returncode == 2, result.stderr
    assert line in result.stderr.splitlines()[-1]
    assert "Config" not in result.stderr and "Traceback" not in result.stderr


def test_a_misspelt_doctor_flag_names_the_flag_meant() -> None:
    """`kvgate doctor` has its own one-line usage errors: they name the flag meant too."""
    result = subprocess.run([*KVGATE, "doctor", "--windw", "5m"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30, env=ENV)
    assert result.returncode == 2
    assert result.stderr.strip() == ("kvgate doctor: unrecognized arguments: --windw 5m "
                                     "(did you mean --window?) (see `kvgate doctor --help`)")
