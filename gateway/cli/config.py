"""`kvgate config check [FILE]`: validate a configuration and print the effective result.

The effective config is the file merged with ``KVGATE_<SECTION>__<KEY>`` overrides and all
defaults, as YAML, with secrets (admin token, salt secret, Redis URL, vLLM API keys) redacted.
Exit status 0 when valid, 2 with an error naming the field otherwise. Secrets missing from
this environment (or a salt secret too short) are warned about on stderr; with ``--strict``
the exit status is 1 when `kvgate serve` would refuse to start for one of them, and their
lines say ``error:`` (the salt secret with authentication on, a pool's `api_key_env`
variable, Kubernetes discovery with no API server, `server.workers` above 1 without
``KVGATE_REDIS_URL``, a replica listed at the gateway's own port): run a strict check in
the environment of the process that serves, a plain one anywhere (e.g. a CI job without
secrets).
"""

from __future__ import annotations

import os
import sys

import yaml

from gateway.cli.parser import Parser
from gateway.config import (
    MIN_SECRET_CHARS,
    NO_POOLS,
    KvgateConfig,
    discovery_problems,
    epp_ports,
    load_config,
    own_address_replicas,
    redacted_dump,
    salt_secret,
    serve_ports,
    unknown_env,
)
from gateway.config.fair_ids import unknown_fairness_tenants
from gateway.config.spills import start_spill_warnings
from gateway.errors import ConfigError
from gateway.workers import WORKERS_NEED_REDIS, workers_apart

__all__ = ["main"]


def main(argv: list[str]) -> int:
    p = Parser(prog="kvgate config", description=__doc__.splitlines()[0])
    # metavar: argparse names a missing one by it ("required: command", not the dest)
    sub = p.add_subparsers(dest="action", required=True, metavar="command")
    check = sub.add_parser("check", help="validate and print the effective configuration")
    check.add_argument("file", nargs="?", help="YAML file (default: $KVGATE_CONFIG)")
    check.add_argument("--strict", action="store_true",
                       help="exit 1 where `kvgate serve` would refuse to start (those lines "
                            "then say error:)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.file)
    except ConfigError as exc:
        message = exc.message
        if message.startswith(NO_POOLS):
            # `--config` and `--upstream` are `kvgate serve`'s: here the file is an argument
            path = args.file or os.environ.get("KVGATE_CONFIG")
            message = (f"{NO_POOLS} in {path}" if path else
                       f"{NO_POOLS}: no configuration file given (`kvgate config check FILE`, "
                       "or set KVGATE_CONFIG)")
        print(f"kvgate config: {message}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(redacted_dump(cfg), sort_keys=False), end="")
    refused = False
    for line, refuses in secret_warnings(cfg):
        # what fails a strict check is an error, said as such (it was "warning:" above exit 1)
        kind = "error" if refuses and args.strict else "warning"
        print(f"kvgate config: {kind}: {line}", file=sys.stderr)
        refused = refused or refuses
    for line in unknown_env(cfg):
        print(line, file=sys.stderr)
    return 1 if refused and args.strict else 0


REFUSES = ": `kvgate serve` will refuse to start"


def secret_warnings(cfg: KvgateConfig) -> list[tuple[str, bool]]:
    """What is missing from the environment (or files) for this config to serve as meant:
    (warning, True when `kvgate serve` refuses to start for it)."""
    out = []
    try:
        secret = salt_secret(cfg)
    except ConfigError as exc:
        out.append((exc.message + REFUSES, True))
        secret = ""
    if secret and len(secret.encode()) < MIN_SECRET_CHARS:
        out.append((f"the salt secret is shorter than {MIN_SECRET_CHARS} bytes" + REFUSES, True))
    if cfg.tenancy.auth and secret is None:
        out.append(("authentication is on but no salt secret is set (KVGATE_SALT_SECRET or "
                    "tenancy.salt_secret_file)" + REFUSES, True))
    for name, pool in cfg.pools.items():
        if pool.api_key_env and not os.environ.get(pool.api_key_env):
            out.append((f"pools.{name}.api_key_env: the environment variable "
                        f"{pool.api_key_env} is not set (or empty)" + REFUSES, True))
    out += [(problem + REFUSES, True) for problem in discovery_problems(cfg)]
    out += [(loop + REFUSES, True) for loop in own_address_replicas(cfg, serve_ports(cfg))]
    epp_only = {port: name for port, name in epp_ports(cfg).items()
                if port not in serve_ports(cfg)}
    out += [(loop + ": `kvgate epp` will refuse to start", False)
            for loop in own_address_replicas(cfg, epp_only)]
    if cfg.server.workers > 1 and cfg.redis_url is None:
        out.append((WORKERS_NEED_REDIS + REFUSES, True))
    if (apart := workers_apart(cfg)) is not None:
        out.append((apart, False))
    out += [(line, False) for line in unknown_fairness_tenants(cfg)]
    out += [(line, False) for line in start_spill_warnings(cfg)]
    if cfg.admin_token is None:
        note = ""
        if cfg.tenancy.auth and cfg.redis_url is None:  # config tenants get no keys either
            note = ": nobody can ever get an API key"
        out.append((f"KVGATE_ADMIN_TOKEN is not set: the admin API refuses every call{note}",
                    False))
    return out
