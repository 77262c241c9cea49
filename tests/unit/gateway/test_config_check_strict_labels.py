"""`kvgate config check --strict`: the lines that make it exit 1 say `error:` (they said
`warning:` above a failed exit status, so a CI log read as "passed with warnings"); without
`--strict`, or for what `kvgate serve` starts with anyway, they stay warnings."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.cli.config import main

CONFIG = {"pools": {"a": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
          "server": {"workers": 2}}


@pytest.fixture
def path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for name in ("KVGATE_CONFIG", "KVGATE_SALT_SECRET", "KVGATE_ADMIN_TOKEN",
                 "KVGATE_REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVGATE_SALT_SECRET", "config-check-secret-0123456789")
    file = tmp_path / "k.yaml"
    file.write_text(yaml.safe_dump(CONFIG))
    return str(file)


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("kvgate config: ")]


def test_strict_names_what_fails_it_an_error(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--strict", path]) == 1
    lines = _lines(capsys.readouterr().err)
    errors = [line for line in lines if line.startswith("kvgate config: error: ")]
    assert len(errors) == 1 and "server.workers > 1 needs KVGATE_REDIS_URL" in errors[0], lines
    assert "will refuse to start" in errors[0]
    # an unset admin token fails nothing: a warning still
    assert [line for line in lines if "KVGATE_ADMIN_TOKEN is not set" in line] == [
        line for line in lines if line.startswith("kvgate config: warning: ")] != []


def test_plain_check_warns(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", path]) == 0
    lines = _lines(capsys.readouterr().err)
    assert lines and all(line.startswith("kvgate config: warning: ") for line in lines), lines
