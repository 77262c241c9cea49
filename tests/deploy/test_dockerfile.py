"""The Dockerfile, checked without a Docker engine: its structure, and (slow) that its
entrypoint runs from a clean virtualenv built the way its build stage builds one."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_TOOLS = ("gcc", "g++", "build-essential", "make", "clang", "python3-dev", "curl", "wget")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, op: str) -> list[str]:
        return [arg for name, arg in self.instructions if name == op]


def parse(text: str) -> list[Stage]:
    """Instructions per stage; comments dropped, backslash continuations joined."""
    logical, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    stages: list[Stage] = []
    for line in logical:
        op, _, arg = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            parts = arg.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(parts[0], name))
        else:
            assert stages, f"{op} before FROM"
            stages[-1].instructions.append((op, arg.strip()))
    return stages


STAGES = parse((ROOT / "Dockerfile").read_text())
FINAL = STAGES[-1]


def test_multi_stage_on_slim_python_311() -> None:
    assert len(STAGES) >= 2
    assert all(s.base.startswith("python:3.11-slim") for s in STAGES)
    names = {s.name for s in STAGES[:-1]}
    copies_from = [a for a in FINAL.args("COPY") if a.startswith("--from=")]
    assert copies_from and all(a.split()[0].removeprefix("--from=") in names for a in copies_from)
    # The runtime stage copies nothing from the build context: only the built venv.
    assert all(a.startswith("--from=") for a in FINAL.args("COPY"))


def test_runtime_has_no_build_tools() -> None:
    for run in FINAL.args("RUN"):
        assert not any(tool in run.split() for tool in BUILD_TOOLS), run
        assert "pip install" not in run


def test_runs_as_a_numeric_non_root_user() -> None:
    (user,) = FINAL.args("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric: Kubernetes' runAsNonRoot can check it
    # The user must be the last identity set before the entrypoint.
    ops = [op for op, _ in FINAL.instructions]
    assert ops.index("USER") > max(i for i, op in enumerate(ops) if op == "RUN")


def test_entrypoint_and_healthcheck() -> None:
    (entry,) = FINAL.args("ENTRYPOINT")
    assert json.loads(entry) == ["kvgate", "serve"]  # exec form: signals reach kvgate
    (health,) = FINAL.args("HEALTHCHECK")
    cmd = json.loads(health.split("CMD", 1)[1].strip())
    assert cmd[0] == "python"  # slim has no curl
    assert "/healthz" in cmd[-1]
    compile(cmd[-1], "healthcheck", "exec")  # the probe is valid Python


def test_build_context_sources_exist_and_secrets_are_ignored() -> None:
    for stage in STAGES[:-1]:
        for arg in stage.args("COPY"):
            for src in arg.split()[:-1]:
                assert (ROOT / src).exists(), src
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".env"} <= set(ignored)


@pytest.mark.slow
@pytest.mark.timeout(600)  # a cold pip cache downloads every dependency
def test_entrypoint_runs_from_a_clean_venv(tmp_path: Path) -> None:
    """Slow (a pip install from the package registry, ~30-60 s): rebuild the build stage's venv."""
    (build,) = [s for s in STAGES if s.name == "build"]
    src = tmp_path / "src"
    src.mkdir()
    for arg in build.args("COPY"):  # the same files the build stage copies
        *sources, _ = arg.split()
        for name in sources:
            path = ROOT / name
            if path.is_dir():
                shutil.copytree(path, src / name, ignore=shutil.ignore_patterns(
                    "__pycache__", "*.pyc", "results"))
            else:
                shutil.copy2(path, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
           "--disable-pip-version-check", str(src)]
    subprocess.run(pip, check=True, timeout=540, cwd=tmp_path)
    shutil.rmtree(src)  # the install must not depend on the copied sources
    for argv in (["--help"], ["serve", "--help"]):
        out = subprocess.run([str(venv / "bin" / "kvgate"), *argv], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "serve" in out.stdout
