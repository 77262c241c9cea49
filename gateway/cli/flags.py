"""argparse types of the flags that set a whole-number configuration key (`--port`,
`--workers`, ...), checked within the key's own bounds as the flags are read: a bad value is
refused naming the flag (``argument --port: '70000': expected a whole number from 0 to
65535``), not the key it sets (``server.port``: a key the user never wrote; `kvgate demo` has
no configuration at all). `tests/unit/gateway/test_cli_flags.py` holds the bounds to the
configuration's."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["ADMIN_PORT", "FALLBACKS", "PORT", "WORKERS", "whole_number"]


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a whole number from {low} to {high}")
        return value
    return parse


PORT = whole_number(0, 65535)  # server.port, epp.port (0: any free port)
ADMIN_PORT = whole_number(1, 65535)  # server.admin_port
WORKERS = whole_number(1, 64)  # server.workers
FALLBACKS = whole_number(0, 9)  # epp.fallbacks
