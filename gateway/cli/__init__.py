"""The `kvgate` command: a thin dispatcher to sub-commands.

Each sub-command lives in its own module exposing ``main(argv: list[str]) -> int``: the
gateway's own in this package (`serve`, `demo`, `config`, `admin`), the others beside the
feature they drive (`gateway.epp.cli`, `gateway.epp.envoy_cli`, `gateway.doctor.cli`,
`loadtest.sim.cli`, `loadtest.replay.cli`). A module is imported only when called, so
`kvgate sim` does not pay for the gateway's imports.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys

# name -> (module, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "sim": ("loadtest.sim.cli", "run one simulated vLLM replica"),
    "serve": ("gateway.cli.serve", "run the gateway"),
    "epp": ("gateway.epp.cli", "run the gateway as an Envoy endpoint picker (gRPC ext_proc)"),
    "envoy": ("gateway.epp.envoy_cli", "print the Envoy bootstrap for `kvgate epp` from a config"),
    "demo": ("gateway.cli.demo", "simulated pools + the gateway on loopback (embedded default)"),
    "config": ("gateway.cli.config", "check and print the effective configuration"),
    "replay": ("loadtest.replay.cli", "replay a trace live or offline against routing policies"),
    "admin": ("gateway.cli.admin", "talk to a running gateway's admin API"),
    "doctor": ("gateway.doctor.cli", "diagnose a running gateway: findings, cache return"),
}


def _usage() -> str:
    lines = ["usage: kvgate COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<8} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "run `kvgate help COMMAND` (or `kvgate COMMAND --help`) for its options; "
              "`kvgate --version`"]
    return "\n".join(lines)


def _meant(name: str) -> str:
    """` (did you mean serve?)` for a misspelt command, as a misspelt flag gets."""
    close = difflib.get_close_matches(name, list(COMMANDS), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-V", "--version"):
        from gateway import __version__

        print(f"kvgate {__version__}")
        return 0
    if not args:  # a usage error: the usage goes where errors go
        print(_usage(), file=sys.stderr)
        return 2
    # (`kvgate help help`, `kvgate help --help`: the usage, as `kvgate help` prints it)
    if args[0] in ("-h", "--help") or (args[0] == "help" and args[1:2] in (
            [], ["help"], ["-h"], ["--help"])):
        print(_usage())
        return 0
    if args[0] == "help":  # `kvgate help serve`, as git and pip take it
        args = [args[1], "--help"]
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"kvgate: unknown command {name!r}{_meant(name)}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        result: int = module.main(rest)
        sys.stdout.flush()  # here, so a closed pipe is caught, not reported at exit
    except BrokenPipeError:
        # the reader went away (`kvgate doctor | head -3`): stop quietly. Python's documented
        # pattern (library/signal.html, "Note on SIGPIPE"): point stdout at devnull so the
        # interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return result
