"""The commands' argument parser: argparse's, with the flag meant named for a misspelt one
(`--prot 9000` was "unrecognized arguments: --prot 9000" and no more; Python 3.11's argparse
suggests nothing)."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterator
from typing import NoReturn

__all__ = ["Parser", "suggest"]

UNRECOGNIZED = "unrecognized arguments: "


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        super().error(suggest(self, message))


def suggest(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's ``message``, with the flag meant for the first misspelt one it names."""
    if message.startswith(UNRECOGNIZED):
        known = sorted(set(_option_strings(parser)))
        for word in message.removeprefix(UNRECOGNIZED).split():
            flag = word.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1) if flag.startswith("--") else []
            if close:
                return f"{message} (did you mean {close[0]}?)"
    return message


def _option_strings(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Every long flag of `parser` and of its commands' parsers (argparse reports a command's
    unknown flag from the parser above it)."""
    for action in parser._actions:
        yield from (s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _option_strings(sub)
