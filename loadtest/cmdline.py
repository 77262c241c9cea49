"""The command line a benchmark prints into its results, without this machine's paths."""

from __future__ import annotations

import os
import sys

__all__ = ["shown_command"]


def shown_command(module: str, argv: list[str] | None = None) -> str:
    """``python -m <module> <args>`` with any path argument cut to its file name."""
    args = sys.argv[1:] if argv is None else argv
    shown = [f"<{os.path.basename(a.rstrip(os.sep))}>" if os.sep in a else a for a in args]
    return " ".join(["python", "-m", module, *shown])
