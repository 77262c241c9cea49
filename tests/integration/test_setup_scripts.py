"""The set-up scripts as a user (or CI) runs them, on a copy of the project whose tools are
stand-ins that only record how they were called: `scripts/demo` installs the demo extra only
and no redis-server, `.ci/run` -> `scripts/test` installs everything, redis-server from
Debian's packages included, then runs ruff, mypy and pytest; the package declares an SPDX
license string. Nothing is installed or started for real."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.support.procs import ROOT

RECORDER = '#!/bin/bash\necho "{name} $*" >> "$KVGATE_TEST_LOG"\n'


def _tool(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def fake_project(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A copy of the scripts with recording stand-ins for python, kvgate, pip's venv, apt-get,
    ruff, mypy and pytest; PATH holds only those and a few coreutils (no redis-server)."""
    project = tmp / "project"
    shutil.copytree(ROOT / "scripts", project / "scripts")
    shutil.copytree(ROOT / ".ci", project / ".ci")
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    venv_bin = project / ".venv" / "bin"
    for name in ("python", "kvgate"):
        _tool(venv_bin / name, RECORDER.format(name=name))
    _tool(venv_bin / "activate", "")  # sourced by scripts/test
    fakebin = tmp / "bin"
    for name in ("apt-get", "ruff", "mypy", "pytest"):
        _tool(fakebin / name, RECORDER.format(name=name))
    _tool(fakebin / "sudo", '#!/bin/bash\nexec "$@"\n')
    for name in ("bash", "dirname", "id", "touch", "rm", "env"):
        real = shutil.which(name)
        assert real is not None
        (fakebin / name).symlink_to(real)
    env = {"PATH": str(fakebin), "HOME": str(tmp), "KVGATE_TEST_LOG": str(tmp / "calls.log")}
    return project, env


def calls(env: dict[str, str]) -> list[str]:
    return Path(env["KVGATE_TEST_LOG"]).read_text().splitlines()


def installed_extras(log: list[str]) -> set[str]:
    found = [m for line in log if (m := re.fullmatch(r"python -m pip install --quiet -e \.\[(.*)\]",
                                                     line))]
    assert len(found) == 1, log
    return set(found[0].group(1).split(","))


def test_demo_installs_only_what_it_needs(tmp_path: Path) -> None:
    project, env = fake_project(tmp_path)
    result = subprocess.run([str(project / "scripts" / "demo"), "--port", "8123"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    log = calls(env)
    assert installed_extras(log) == {"demo"}
    assert not [line for line in log if line.startswith("apt-get")]  # no redis-server
    assert log[-1] == "kvgate demo --port 8123"
    assert ". .venv/bin/activate" in result.stderr  # how to get `kvgate` on PATH in a new shell


def test_ci_installs_everything_with_redis_then_checks(tmp_path: Path) -> None:
    project, env = fake_project(tmp_path)
    result = subprocess.run([str(project / ".ci" / "run")], cwd=tmp_path,
                            env={**env, "KVGATE_EXTRAS": "demo"}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    log = calls(env)
    assert installed_extras(log) == {"demo", "test", "bench"}  # whatever KVGATE_EXTRAS says
    assert "apt-get install -y -qq redis-server" in log
    assert [line.split()[0] for line in log[-3:]] == ["ruff", "mypy", "pytest"]
    assert log[-1] == "pytest -q"


def test_setup_installs_again_only_when_needed(tmp_path: Path) -> None:
    project, env = fake_project(tmp_path)
    setup = [str(project / "scripts" / "setup")]
    for _ in range(2):
        subprocess.run(setup, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=60)
    assert len([line for line in calls(env) if " -e " in line]) == 1  # stamped
    os.utime(project / "pyproject.toml")  # newer than the stamp: install again
    subprocess.run(setup, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=60)
    assert len([line for line in calls(env) if " -e " in line]) == 2


FAKE_PYTHON3 = """#!/bin/bash
echo "python3 $*" >> "$KVGATE_TEST_LOG"
if [ "$1" = "-c" ]; then exit 1; fi  # `import ensurepip`: Debian's python3 without python3-venv
mkdir -p .venv/bin && cp "$(dirname "$0")/venv-python" .venv/bin/python
"""


def test_setup_creates_a_venv_left_without_pip_again(tmp_path: Path) -> None:
    """Debian's python3 without python3-venv: a first `python3 -m venv` left .venv/bin/python
    without pip; the next run installs python3-venv and creates the venv again, and the run
    after that is a no-op."""
    project, env = fake_project(tmp_path)
    broken = project / ".venv" / "bin" / "python"
    broken.write_text("#!/bin/bash\nexit 1\n")  # `-m pip` fails: No module named pip
    fakebin = Path(env["PATH"])
    _tool(fakebin / "python3", FAKE_PYTHON3)
    _tool(fakebin / "venv-python", RECORDER.format(name="python"))
    for name in ("mkdir", "cp"):
        (fakebin / name).symlink_to(shutil.which(name) or name)
    setup = [str(project / "scripts" / "setup")]
    result = subprocess.run(setup, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "creating it again" in result.stderr
    log = calls(env)
    assert "apt-get install -y -qq python3-venv redis-server" in log
    assert "python3 -m venv .venv" in log and " -e " in log[-1]
    before = len(log)
    _tool(fakebin / "redis-server", "")  # what the (recorded) apt-get would have installed
    subprocess.run(setup, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=60)
    assert calls(env)[before:] == ["python -m pip --version"]  # all there: nothing to do


def test_setup_without_root_or_sudo_says_what_to_install(tmp_path: Path) -> None:
    project, env = fake_project(tmp_path)
    fakebin = Path(env["PATH"])
    (fakebin / "sudo").unlink()
    (fakebin / "id").unlink()
    _tool(fakebin / "id", "#!/bin/bash\necho 1000\n")
    result = subprocess.run([str(project / "scripts" / "setup")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "needs root or sudo" in result.stderr and "apt-get install redis-server" \
        in result.stderr
    assert not [line for line in calls(env) if line.startswith("apt-get")]


def test_pyproject_uses_an_spdx_license_string() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # not the deprecated {text = ...} table
    setuptools = next(r for r in meta["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.findall(r">=(\d+)", setuptools)[0]) >= 77  # SPDX strings need setuptools 77
    demo = meta["project"]["optional-dependencies"]["demo"]
    assert [d for d in demo if d.startswith("openai")]  # the demo's printed snippet needs it


def _imported_packages(folder: Path) -> set[str]:
    """Top-level third-party modules the files under `folder` import (absolute imports)."""
    local = {"gateway", "routing", "loadtest", "tests", "__future__"}
    found: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - local


def test_every_package_the_tests_import_is_declared() -> None:
    """scripts/setup installs the dependencies and the test extra: a package the tests import
    that only came along with another (jsonschema, through kubernetes-validate) could go with
    that package's next release."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~;\[ ]", spec)[0].lower().replace("_", "-")
                for spec in [*meta["dependencies"], *meta["optional-dependencies"]["test"]]}
    providers = importlib.metadata.packages_distributions()
    undeclared = sorted(
        module for module in _imported_packages(ROOT / "tests")
        if not {d.lower().replace("_", "-") for d in providers.get(module, [module])} & declared)
    assert undeclared == []


def _python(version: str) -> str:
    """A stand-in python3 of ``version`` (`-c` prints major and minor, as setup asks), whose
    `-m venv .venv` makes a recording venv python."""
    major, minor, _ = version.split(".")
    return f"""#!/bin/bash
echo "$(basename "$0") $*" >> "$KVGATE_TEST_LOG"
case "$1" in
  -V) echo "Python {version}";;
  -c) echo "{major} {minor}";;
  -m) mkdir -p .venv/bin && cp "$(dirname "$0")/venv-python" .venv/bin/python;;
esac
"""


def _old_venv(project: Path, env: dict[str, str]) -> Path:
    (project / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.9.2\n")
    fakebin = Path(env["PATH"])
    _tool(fakebin / "python3", _python("3.9.2"))
    _tool(fakebin / "python3.12", _python("3.12.1"))
    _tool(fakebin / "venv-python", RECORDER.format(name="python"))
    for name in ("mkdir", "cp", "basename"):
        (fakebin / name).symlink_to(shutil.which(name) or name)
    return project / "scripts" / "setup"


def test_setup_refuses_a_python_older_than_3_11(tmp_path: Path) -> None:
    """A .venv made by an older python3, and python3 itself older: one line saying what is
    needed and how to give it; the .venv is left as it was and nothing is installed. Before,
    the old .venv was kept and pip failed on the package's requires-python."""
    project, env = fake_project(tmp_path)
    setup = _old_venv(project, env)
    result = subprocess.run([str(setup)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "needs Python >= 3.11" in result.stderr and "Python 3.9.2" in result.stderr
    assert "PYTHON=python3.11" in result.stderr
    assert (project / ".venv" / "pyvenv.cfg").exists()
    assert not [line for line in calls(env) if "install" in line]
    # no .venv at all: refused the same, before anything is installed
    shutil.rmtree(project / ".venv")
    result = subprocess.run([str(setup)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1 and "needs Python >= 3.11" in result.stderr
    assert not [line for line in calls(env) if "install" in line or "venv" in line]


def test_setup_makes_an_old_venv_again_with_the_python_given(tmp_path: Path) -> None:
    project, env = fake_project(tmp_path)
    setup = _old_venv(project, env)
    _tool(Path(env["PATH"]) / "redis-server", "")
    result = subprocess.run([str(setup)], cwd=tmp_path, env={**env, "PYTHON": "python3.12"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "older than 3.11: creating it again" in result.stderr
    log = calls(env)
    assert "python3.12 -m venv .venv" in log and " -e " in log[-1]
