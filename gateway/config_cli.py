"""`kvgate config check [FILE]`: validate a configuration and print the effective result.

The effective config is the file merged with ``KVGATE_<SECTION>__<KEY>`` overrides and all
defaults, as YAML, with secrets (admin token, salt secret, Redis URL, vLLM API keys) redacted.
Exit status 0 when valid, 2 with an error naming the field otherwise.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from gateway.config import load_config, redacted_dump
from gateway.errors import ConfigError

__all__ = ["main"]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate config", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="action", required=True)
    check = sub.add_parser("check", help="validate and print the effective configuration")
    check.add_argument("file", nargs="?", help="YAML file (default: $KVGATE_CONFIG)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.file)
    except ConfigError as exc:
        print(f"kvgate config: {exc.message}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(redacted_dump(cfg), sort_keys=False), end="")
    return 0
