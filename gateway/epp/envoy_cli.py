"""`kvgate envoy`: print the Envoy bootstrap for `kvgate epp` from a kvgate configuration.

The bootstrap is `envoy_config`'s (deploy/envoy/ is the same with the defaults), with the
operator's own settings in it: the timeouts and retries of the config's `upstream` section,
the picker's address (default ``127.0.0.1:<epp.port>``, a sidecar), Envoy's circuit breakers
(``--max-requests``) and its limit on client connections (``--max-connections``), and with
``epp.fallbacks`` > 0 a cluster listing the pools' replicas (Envoy's ``override_host`` policy
walks the picker's whole list). Exit 2 with one line when
the config or an option is wrong, or when fallbacks need endpoints the file does not list.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from gateway.cli.parser import Parser
from gateway.config import KvgateConfig, load_config
from gateway.epp.envoy import MAX_CONNECTIONS, MAX_REQUESTS, envoy_config, render
from gateway.errors import ConfigError
from gateway.urls import is_ip

__all__ = ["endpoints_of", "main"]


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="kvgate envoy", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="kvgate's YAML config file (default: $KVGATE_CONFIG)")
    p.add_argument("--upstream", action="append", metavar="URL",
                   help="a replica, http://IP:PORT (repeat; one pool, as `kvgate epp`)")
    p.add_argument("--listen-port", type=int, default=8081, help="Envoy's listener (8081)")
    p.add_argument("--listen-host", default="0.0.0.0", help="Envoy's listen address")
    p.add_argument("--picker", metavar="HOST:PORT",
                   help="where `kvgate epp` listens (default 127.0.0.1:<epp.port>)")
    p.add_argument("--admin-port", type=int, help="Envoy's admin port on 127.0.0.1 (none)")
    p.add_argument("--max-requests", type=int, default=MAX_REQUESTS,
                   help=f"Envoy's circuit breakers on the replicas ({MAX_REQUESTS:,})")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                   help="client connections Envoy holds open at once; past it a new one is "
                        f"closed ({MAX_CONNECTIONS:,})")
    p.add_argument("--endpoint", action="append", metavar="IP:PORT",
                   help="a replica for the fallback cluster (repeat; default with "
                        "epp.fallbacks > 0: the pools' replicas)")
    p.add_argument("--out", help="write here instead of standard output")
    return p


def _hostport(value: str, what: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} must be HOST:PORT, not {value[:100]!r}")
    return value


def _port(value: int | None, what: str) -> None:
    if value is not None and not 0 < value < 65536:
        raise ConfigError(f"{what} must be a port from 1 to 65535, not {value}")


def endpoints_of(cfg: KvgateConfig) -> list[str]:
    """The pools' replicas as ``IP:PORT`` for a fallback cluster (Envoy's static cluster
    takes addresses; replicas found by discovery or listed by name have to be given)."""
    out: list[str] = []
    for name, pool in cfg.pools.items():
        if pool.discovery:
            raise ConfigError(f"pools.{name} finds its replicas by discovery: list the "
                              "fallback cluster's endpoints with --endpoint IP:PORT")
        for url in pool.replicas:
            parts = urlsplit(url)
            host = parts.hostname or ""
            if not is_ip(host):
                raise ConfigError(f"pools.{name}: {host[:100]!r} is a name; Envoy's static "
                                  "cluster needs IP addresses (--endpoint IP:PORT)")
            port = parts.port or (443 if parts.scheme == "https" else 80)
            out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    return out


def _render(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The bootstrap's text and warnings for stderr."""
    if args.config and args.upstream:
        raise ConfigError("use either --config or --upstream, not both")
    if args.upstream:
        path = ""
        cfg = load_config("", quick=True, overrides={
            "pools": {"default": {"replicas": list(args.upstream)}}, "models": {}})
    else:
        path = args.config if args.config is not None else os.environ.get("KVGATE_CONFIG", "")
        cfg = load_config(args.config)
    _port(args.listen_port, "--listen-port")
    _port(args.admin_port, "--admin-port")
    picker = _hostport(args.picker or f"127.0.0.1:{cfg.epp.port}", "--picker")
    if args.endpoint:
        endpoints = [_hostport(e, "--endpoint") for e in args.endpoint]
    else:
        endpoints = endpoints_of(cfg) if cfg.epp.fallbacks else []
    warnings = []
    if any(u.startswith("https://") for pool in cfg.pools.values() for u in pool.replicas):
        warnings.append("some replicas are https://: the bootstrap's replica cluster speaks "
                        "plain HTTP (add a TLS transport_socket to kvgate_pool)")
    if endpoints and not cfg.epp.fallbacks:
        warnings.append("endpoints listed but epp.fallbacks is 0: the picker names one "
                        "endpoint, so Envoy never fails over")
    try:
        config = envoy_config(
            listen_port=args.listen_port, listen_host=args.listen_host, picker=picker,
            endpoints=endpoints or None, admin_port=args.admin_port, upstream=cfg.upstream,
            max_requests=args.max_requests, max_connections=args.max_connections)
    except ValueError as exc:
        flag = "--max-connections" if "max_connections" in str(exc) else "--max-requests"
        raise ConfigError(f"{flag}: {exc}") from None
    source = Path(path).name if path else "--upstream" if args.upstream else "the defaults"
    comment = (f"Envoy in front of `kvgate epp`, generated by `kvgate envoy` from {source}:\n"
               "timeouts and retries from its upstream section. Run: envoy -c THIS_FILE")
    return render(config, comment), warnings


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        text, warnings = _render(args)
    except ConfigError as exc:
        print(f"kvgate envoy: {exc.message}", file=sys.stderr)
        return 2
    for line in warnings:
        print(f"kvgate envoy: warning: {line}", file=sys.stderr)
    if args.out:
        try:
            Path(args.out).write_text(text)
        except OSError as exc:
            print(f"kvgate envoy: cannot write {args.out}: {exc.strerror}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0
