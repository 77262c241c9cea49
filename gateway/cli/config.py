"""`kvgate config check [FILE]`: validate a configuration and print the effective result.

The effective config is the file merged with ``KVGATE_<SECTION>__<KEY>`` overrides and all
defaults, as YAML, with secrets (admin token, salt secret, Redis URL, vLLM API keys) redacted.
Exit status 0 when valid, 2 with an error naming the field otherwise. Secrets that are missing
for the configuration to work (the salt secret with authentication on; the admin token) are
warned about on stderr; they do not make the check fail, since they come from the environment
of the process that serves.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from gateway.config import KvgateConfig, load_config, redacted_dump, salt_secret
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
    for line in secret_warnings(cfg):
        print(f"kvgate config: warning: {line}", file=sys.stderr)
    return 0


def secret_warnings(cfg: KvgateConfig) -> list[str]:
    """What is missing from the environment (or files) for this config to serve as meant."""
    out = []
    try:
        secret = salt_secret(cfg)
    except ConfigError as exc:
        out.append(exc.message)
        secret = ""
    if cfg.tenancy.auth and secret is None:
        out.append("authentication is on but no salt secret is set (KVGATE_SALT_SECRET or "
                   "tenancy.salt_secret_file): `kvgate serve` will refuse to start")
    if cfg.admin_token is None:
        note = ""
        if cfg.tenancy.auth and not cfg.tenants and cfg.redis_url is None:
            note = " and no tenants are configured: nobody can ever get an API key"
        out.append(f"KVGATE_ADMIN_TOKEN is not set: the admin API refuses every call{note}")
    return out
