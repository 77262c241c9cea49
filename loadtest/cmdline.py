"""The command line a benchmark prints into its results, without this machine's paths."""

from __future__ import annotations

import os
import sys

__all__ = ["shown_command"]


def _shown(arg: str) -> str:
    flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    if os.sep in value and "://" not in value:  # a path, not a URL
        value = f"<{os.path.basename(value.rstrip(os.sep))}>"
    return f"{flag}{eq}{value}"


def shown_command(module: str, argv: list[str] | None = None) -> str:
    """``python -m <module> <args>`` with any path argument cut to its file name."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", "-m", module, *map(_shown, args)])
