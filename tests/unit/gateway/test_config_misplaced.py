"""A config key written in the wrong place, read by the real loader from a real file: a field
of another section (or outside a tier's `limits`) names where it belongs -- it was "unknown
field", or a misleading "did you mean" a field of the section it was in --, a secret written
in a section names its variable, and a secret at the file's top level is refused: it was
taken quietly, where docs/configuration.md says secrets come only from the environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import load_config
from gateway.errors import ConfigError

POOLS = "pools:\n  a: {served_model: m, replicas: ['http://127.0.0.1:9']}\n"


def _error(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> str:
    path = tmp_path / "kvgate.yaml"
    path.write_text(text if text.startswith("pools:") else POOLS + text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), environ=environ or {})
    return info.value.message


@pytest.mark.parametrize(("text", "line"), [
    ("server:\n  first_byte_timeout_s: 10\n",  # was: did you mean body_timeout_s?
     "server.first_byte_timeout_s: unknown field (it belongs at upstream.first_byte_timeout_s)"),
    ("port: 9000\n", "port: unknown field (it belongs at server.port or epp.port)"),
    ("workers: 2\n", "workers: unknown field (it belongs at server.workers)"),
    ("upstream:\n  interval_s: 1\n",
     "upstream.interval_s: unknown field (it belongs at health.interval_s or doctor.interval_s)"),
    ("tiers:\n  free: {rpm: 60}\n",
     "tiers.free.rpm: unknown field (it belongs at tiers.free.limits.rpm)"),
    ("flow:\n  band: 1\n", "flow.band: unknown field (it belongs at tiers.<tier>.flow.band)"),
    ("replicas: ['http://127.0.0.1:9']\n",
     "replicas: unknown field (it belongs at pools.<pool>.replicas)"),
])
def test_a_field_of_another_section_says_where_it_belongs(tmp_path: Path, text: str,
                                                          line: str) -> None:
    assert _error(tmp_path, text).splitlines()[1].strip() == line


@pytest.mark.parametrize(("text", "line"), [
    ("server:\n  prot: 9000\n", "server.prot: unknown field (did you mean port?)"),
    ("sever:\n  port: 9000\n", "sever: unknown field (did you mean server?)"),
    # a part of the field's name: too far from `served_model` for a close match
    ("pools:\n  b: {model: m, replicas: ['http://127.0.0.1:8']}\n",
     "pools.b.model: unknown field (did you mean served_model?)"),
])
def test_a_misspelt_field_still_gets_the_close_one(tmp_path: Path, text: str,
                                                   line: str) -> None:
    assert _error(tmp_path, text).splitlines()[1].strip() == line


@pytest.mark.parametrize(("text", "line"), [
    # was: did you mean admin_port?
    ("server:\n  admin_token: 0123456789abcdef0123\n",
     "server.admin_token: unknown field (a secret, read only from the environment variable "
     "KVGATE_ADMIN_TOKEN)"),
    ("tenancy:\n  salt_secret: 0123456789abcdef0123\n",
     "tenancy.salt_secret: unknown field (a secret, read only from the environment variable "
     "KVGATE_SALT_SECRET (or tenancy.salt_secret_file))"),
])
def test_a_secret_in_a_section_names_its_variable(tmp_path: Path, text: str, line: str) -> None:
    assert _error(tmp_path, text).splitlines()[1].strip() == line


def test_a_variable_for_the_wrong_section_says_where_it_belongs() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, environ={"KVGATE_SERVER__FIRST_BYTE_TIMEOUT_S": "10"},
                    overrides={"pools": {"a": {"replicas": ["http://127.0.0.1:9"]}}})
    assert info.value.message.splitlines()[1].strip() == (
        "server.first_byte_timeout_s: unknown field (it belongs at "
        "upstream.first_byte_timeout_s) (from KVGATE_SERVER__FIRST_BYTE_TIMEOUT_S)")


@pytest.mark.parametrize(("key", "var"), [("redis_url", "KVGATE_REDIS_URL"),
                                          ("admin_token", "KVGATE_ADMIN_TOKEN"),
                                          ("salt_secret", "KVGATE_SALT_SECRET")])
def test_a_secret_in_the_file_is_refused_naming_its_variable(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, var: str) -> None:
    """`kvgate config check` (and `kvgate serve`, through the same loader) exit 2 on one line
    naming the variable, and never repeat the value."""
    value = "redis://:hunter2hunter2@127.0.0.1:6379/0" if key == "redis_url" else "s" * 24
    path = tmp_path / "kvgate.yaml"
    path.write_text(f"{POOLS}{key}: '{value}'\n")
    assert main(["config", "check", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"kvgate config: config file {path}: {key}: secrets are read "
                                   f"only from the environment: set {var}")
    assert len(captured.err.splitlines()) == 1
    assert value not in captured.err and "hunter2" not in captured.err


@pytest.mark.parametrize(("name", "meant"), [
    ("KVGATE_SERVER_PORT", "KVGATE_SERVER__PORT"),  # one underscore where two go
    ("KVGATE_PORT", "KVGATE_SERVER__PORT or KVGATE_EPP__PORT"),  # the section left out
    ("KVGATE_LOG_LEVEL", "KVGATE_SERVER__LOG_LEVEL"),
    ("KVGATE_FLOW_ENABLED", "KVGATE_FLOW__ENABLED"),
    # its own variables misspelt: KVGATE_REDIS left the gateway on the in-memory store
    ("KVGATE_REDIS", "KVGATE_REDIS_URL"),
    ("KVGATE_ADMIN_TOKENS", "KVGATE_ADMIN_TOKEN"),
])
def test_a_stray_variable_names_the_one_meant(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        name: str, meant: str) -> None:
    """It said "check the spelling", never which variable was meant."""
    for var in [v for v in os.environ if v.startswith("KVGATE_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv(name, "1")
    path = tmp_path / "kvgate.yaml"
    path.write_text(POOLS)
    assert main(["config", "check", str(path)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if name in line]
    assert warnings == [f"kvgate: warning: {name}: not a kvgate setting (did you mean {meant}?)"]
