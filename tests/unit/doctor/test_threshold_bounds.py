"""Threshold overrides (`doctor.thresholds`) the rules cannot use are refused when the config
is read: at `min_pool_requests: 0` an idle pool's shares divided by its 0 requests and every
report failed; NaN, infinities and negative numbers made rules that never or always fire."""
from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import load_config
from gateway.doctor.thresholds import DEFAULTS, Thresholds
from gateway.errors import ConfigError


@pytest.mark.parametrize(("name", "value", "said"), [
    ("min_pool_requests", 0, "counts requests: at least 1"),
    ("min_requests", 0.5, "counts requests: at least 1"),
    ("kv_high", -0.1, "finite number >= 0"),
    ("overhead_p99_s", float("nan"), "finite number >= 0"),
    ("itl_high_s", float("inf"), "finite number >= 0"),
])
def test_an_unusable_override_is_refused_by_name(name: str, value: float, said: str) -> None:
    with pytest.raises(ValueError, match=said) as info:
        Thresholds({name: value})
    assert name in str(info.value)


def test_every_default_passes_its_own_check() -> None:
    assert Thresholds(DEFAULTS).as_dict() == DEFAULTS


def test_the_config_file_names_the_threshold(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text("pools:\n  a: {served_model: m, replicas: ['http://127.0.0.1:9']}\n"
                    "doctor:\n  thresholds: {min_pool_requests: 0}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), environ={})
    assert "min_pool_requests" in info.value.message
    assert "at least 1" in info.value.message
