"""The flags that set whole-number configuration keys take what the keys take
(`gateway/cli/flags.py`): their bounds are the configuration's own."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from gateway.cli.flags import ADMIN_PORT, FALLBACKS, PORT, WORKERS
from gateway.cli.serve import build_parser
from gateway.config import load_config
from gateway.epp.cli import build_parser as epp_parser
from gateway.errors import ConfigError

POOLS = {"p": {"served_model": "m", "replicas": ["http://127.0.0.1:9"]}}


@pytest.mark.parametrize(("flag", "section", "key", "low", "high"), [
    (PORT, "server", "port", 0, 65535),
    (PORT, "epp", "port", 0, 65535),
    (ADMIN_PORT, "server", "admin_port", 1, 65535),
    (WORKERS, "server", "workers", 1, 64),
    (FALLBACKS, "epp", "fallbacks", 0, 9),
])
def test_a_flags_bounds_are_its_keys(
    flag: Callable[[str], int], section: str, key: str, low: int, high: int,
) -> None:
    for value in (low, high):
        assert flag(str(value)) == value
        cfg = load_config("", overrides={section: {key: value}, "pools": POOLS}, environ={})
        assert getattr(getattr(cfg, section), key) == value
    for value in (low - 1, high + 1):
        with pytest.raises(argparse.ArgumentTypeError):
            flag(str(value))
        with pytest.raises(ConfigError):
            load_config("", overrides={section: {key: value}, "pools": POOLS}, environ={})
    with pytest.raises(argparse.ArgumentTypeError):
        flag("eight")


@pytest.mark.parametrize("parser", [build_parser, epp_parser])
def test_the_log_level_is_read_in_any_case(parser: Callable[[], argparse.ArgumentParser]) -> None:
    assert parser().parse_args(["--log-level", "WARNING"]).log_level == "warning"
