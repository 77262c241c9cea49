"""The command line a benchmark prints into its results, without this machine's paths."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

__all__ = ["positive", "shown_command"]


def _shown(arg: str) -> str:
    flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if os.sep in value and "://" not in value:  # a path, not a URL
        value = f"<{os.path.basename(value.rstrip(os.sep))}>"
    return f"{flag}{eq}{value}"


def shown_command(module: str, argv: list[str] | None = None) -> str:
    """``python -m <module> <args>`` with any path argument cut to its file name."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", "-m", module, *map(_shown, args)])


def positive(kind: Callable[[str], float], *, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number of `kind` above 0 (or from 0: `zero`). 0 replicas, a
    rate scale of 0 or nan, a sync delay of nan ended in a traceback, or in a table of nan."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not (value >= 0 if zero else value > 0) or not math.isfinite(value):
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected {what} {'of 0 or more' if zero else 'above 0'}")
        return value
    return parse
