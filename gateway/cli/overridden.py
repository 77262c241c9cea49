"""A value of the file (or of a ``KVGATE_*`` variable) that a flag overrides is not used, so it
is not checked with the rest: ``kvgate serve --port 9000`` starts whatever ``server.port``
holds (the flag wins, as the precedence says). An invalid one is still said, once, at start:
dropping the flag later (a changed command line, a copied manifest) would fail on it."""

from __future__ import annotations

import argparse
from typing import Any

from gateway.errors import ConfigError

__all__ = ["SERVER_FLAGS", "flagged_server", "overridden_invalid"]

# the `server` fields a flag of the same name sets (`serve.config_from_args`)
SERVER_FLAGS = ("host", "port", "workers", "log_level", "log_format")


def flagged_server(args: argparse.Namespace) -> dict[str, Any]:
    """The `server` fields the flags given set (a flag not given: None, or "" for a word)."""
    return {name: value for name in SERVER_FLAGS
            if (value := getattr(args, name, None)) not in (None, "")}


def overridden_invalid(args: argparse.Namespace) -> list[str]:
    """The warnings for the `server` fields that flags override and whose file or
    environment value is invalid (empty: none, or no server flag given)."""
    from gateway.cli.serve import config_from_args  # (serve imports this module)

    given = flagged_server(args)
    if not given:
        return []
    without = argparse.Namespace(**{**vars(args), **dict.fromkeys(given)})
    try:
        config_from_args(without)
    except ConfigError as exc:
        lines = [line.strip() for line in exc.message.splitlines()[1:]]
    else:
        return []
    flags = {f"server.{name}": "--" + name.replace("_", "-") for name in given}
    return [f"warning: {line}; not used: {flags[name]} overrides it (fix it: without the "
            "flag kvgate would not start)"
            for line in lines for name in flags if line.startswith(f"{name}:")]
