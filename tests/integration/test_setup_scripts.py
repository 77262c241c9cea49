"""The set-up scripts as a user runs them (in dry-run mode: the install commands are printed,
not run): `scripts/demo` installs only the demo's needs, `scripts/test` (what `.ci/run` calls)
installs everything, redis-server included; the package declares an SPDX license string."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib

from tests.support.procs import ROOT


def dry_run(script: str, *args: str) -> str:
    env = {**os.environ, "KVGATE_SETUP_DRY_RUN": "1"}
    env.pop("KVGATE_EXTRAS", None)
    result = subprocess.run([str(ROOT / "scripts" / script), *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


def installed_extras(out: str) -> set[str]:
    m = re.search(r"pip install --quiet -e \.\[([^\]]*)\]", out)
    assert m, out
    return set(m.group(1).split(","))


def test_demo_installs_only_what_it_needs() -> None:
    out = dry_run("demo", "--port", "8123")
    assert installed_extras(out) == {"demo"}
    assert "redis" not in out
    assert "+ .venv/bin/kvgate demo --port 8123" in out
    assert ". .venv/bin/activate" in out  # how to get `kvgate` on PATH in a new shell


def test_full_setup_installs_everything_with_redis() -> None:
    assert "scripts/test" in (ROOT / ".ci" / "run").read_text()
    assert "KVGATE_EXTRAS=demo,test,bench scripts/setup" in (ROOT / "scripts" / "test").read_text()
    out = dry_run("setup")
    assert installed_extras(out) == {"demo", "test", "bench"}
    assert "apt-get install -y -qq redis-server" in out or "redis-server: already installed" in out


def test_pyproject_uses_an_spdx_license_string() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # not the deprecated {text = ...} table
    setuptools = next(r for r in meta["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.findall(r">=(\d+)", setuptools)[0]) >= 77  # SPDX strings need setuptools 77
    demo = meta["project"]["optional-dependencies"]["demo"]
    assert [d for d in demo if d.startswith("openai")]  # the demo's printed snippet needs it
