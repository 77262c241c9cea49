"""PyYAML's parse errors in one line, for the commands that read YAML files (the config,
`kvgate admin policy put|patch`): its own text spreads over four or more lines. A file that is
not UTF-8 text is worded once for them all (`not_utf8`)."""

from __future__ import annotations

import yaml

__all__ = ["not_utf8", "one_line"]


def not_utf8(exc: UnicodeDecodeError) -> str:
    """Why a YAML file could not be read as UTF-8 (saved as UTF-16, or not the file meant),
    where, and what to do."""
    return (f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}): "
            "save it as UTF-8")


def one_line(exc: yaml.YAMLError) -> str:
    """The problem where it was found, then what was being read and where that began."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return " ".join(str(exc).split())
    mark = exc.problem_mark
    line = f"{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    if exc.context and exc.context_mark is not None:
        start = exc.context_mark
        line += f" ({exc.context} at line {start.line + 1}, column {start.column + 1})"
    elif exc.context:
        line += f" ({exc.context})"
    return line
