"""A public model name is bounded to `NAME_CHARS` characters when it comes from the config
file, as when it comes through the admin API (`PUT /admin/policy`): the error names the file
and the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.config import load_config
from gateway.errors import NAME_CHARS, ConfigError


def _write(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump({
        "pools": {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}},
        "models": {"short": {"default": "p"}, model: {"default": "p"}},
    }))
    return path


def test_a_model_name_of_the_limit_loads(tmp_path: Path) -> None:
    cfg = load_config(str(_write(tmp_path, "x" * NAME_CHARS)), environ={})
    assert "x" * NAME_CHARS in cfg.models


def test_a_longer_model_name_is_refused_naming_the_file_and_key(tmp_path: Path) -> None:
    model = "llama-" + "x" * 5000
    path = _write(tmp_path, model)
    with pytest.raises(ConfigError) as caught:
        load_config(str(path), environ={})
    message = str(caught.value)
    assert str(path) in message
    assert f"models.{model[:40]}" in message and f"at most {NAME_CHARS} characters" in message
    assert str(len(model)) in message
    assert len(message) < 1000  # the name itself is not echoed whole
