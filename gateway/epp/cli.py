"""`kvgate epp`: run kvgate as the endpoint picker of an Envoy-based gateway.

The same configuration as `kvgate serve` (pools, models, tiers, tenants, routing); the
requests come through Envoy's ext_proc stream on the gRPC port (`epp.port`, default 9002,
which also answers gRPC health), and the HTTP port (`server.admin_port`, default 9090)
serves /metrics, /healthz, /readyz and the admin API. Both ports are checked before anything
starts, so a port in use is one line.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any
from urllib.parse import urlsplit

from gateway.cli.flags import ADMIN_PORT, FALLBACKS, PORT
from gateway.cli.parser import Parser
from gateway.cli.serve import (
    ListenError,
    Port,
    bind_sockets,
    bound_socket,
    check_secrets,
    config_from_args,
    run_server,
    start_output,
    start_warnings,
)
from gateway.config import LOG_LEVELS, KvgateConfig, epp_ports
from gateway.errors import ConfigError
from gateway.urls import is_ip
from routing.policies import REGISTRY

__all__ = [
    "DEFAULT_HTTP_PORT", "build_parser", "load", "main", "named_hosts", "stall_cut_by_envoy",
]

DEFAULT_HTTP_PORT = 9090
# where another port is chosen when one is taken (the listen error's hint)
GRPC_PORT = "another gRPC port with --port (epp.port)"
HTTP_PORT = "another HTTP port with --http-port (server.admin_port)"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="kvgate epp",
        description="Run kvgate as the endpoint picker (gRPC ext_proc) of an Envoy gateway.")
    p.add_argument("--config", help="YAML config file (default: $KVGATE_CONFIG)")
    p.add_argument("--upstream", action="append", metavar="URL",
                   help="a vLLM replica's address, http://IP:PORT, without /v1 (repeat); "
                        "one pool")
    p.add_argument("--policy", choices=sorted(REGISTRY), metavar="POLICY",
                   help=f"routing policy: {', '.join(sorted(REGISTRY))} (overrides "
                        "routing.policy)")
    p.add_argument("--host", help="listen address of both ports (overrides server.host)")
    p.add_argument("--port", dest="grpc_port", type=PORT,
                   help="gRPC port: ext_proc and health (overrides epp.port, default 9002)")
    p.add_argument("--http-port", type=ADMIN_PORT, help="HTTP port: /metrics, /readyz, admin "
                   f"API (overrides server.admin_port, default {DEFAULT_HTTP_PORT})")
    p.add_argument("--fallbacks", type=FALLBACKS,
                   help="endpoints after the first in the destination, 0 to 9 (overrides "
                        "epp.fallbacks)")
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, metavar="LOG_LEVEL",
                   help=f"{', '.join(LOG_LEVELS)} (overrides server.log_level)")
    p.add_argument("--log-format", choices=["json", "text"], help="overrides server.log_format")
    p.add_argument("--no-auth", action="store_true",
                   help="single tenant, no API keys (local use only; says so loudly)")
    return p


def load(args: argparse.Namespace) -> KvgateConfig:
    """The configuration with the picker's flags applied."""
    extra: dict[str, dict[str, Any]] = {"server": {}, "epp": {}}
    if args.grpc_port is not None:
        extra["epp"]["port"] = args.grpc_port
    if args.fallbacks is not None:
        extra["epp"]["fallbacks"] = args.fallbacks
    if args.http_port is not None:
        extra["server"]["admin_port"] = args.http_port
    args.port = None  # `kvgate serve`'s HTTP API port: the picker has none, so it cannot
    extra["server"]["port"] = 0  # clash with the HTTP port (`--http-port 8000` was refused)
    # the picker is one process whatever `server.workers` says (its limits, its doctor)
    extra["server"]["workers"] = 1
    cfg = config_from_args(args, extra)
    if cfg.server.admin_port is None:
        extra["server"]["admin_port"] = DEFAULT_HTTP_PORT
        cfg = config_from_args(args, extra)
    return cfg


def named_hosts(cfg: KvgateConfig) -> list[str]:
    """A warning for replicas listed by host name: the data plane connects to the address
    the picker names (an ORIGINAL_DST cluster takes an IP, an override_host cluster the
    address of one of its endpoints), so replicas must be listed by IP."""
    named = sorted({urlsplit(url).hostname or url for pc in cfg.pools.values()
                    for url in pc.replicas if not is_ip(urlsplit(url).hostname or "")})
    if not named:
        return []
    return [f"kvgate epp: warning: replicas listed by name ({', '.join(named)}); Envoy needs "
            "their IP addresses (http://IP:PORT) in x-gateway-destination-endpoint"]


def stall_cut_by_envoy(cfg: KvgateConfig) -> list[str]:
    """A warning when the first-byte timeout is not above the idle one: the bootstrap's
    per-try idle timeout is `first_byte_timeout_s` (`envoy.envoy_config`), and Envoy resets
    a stream stalled that long before the picker ends it with its error event after
    `idle_timeout_s` (the client reads a broken chunked body, not an error)."""
    up = cfg.upstream
    if up.first_byte_timeout_s > up.idle_timeout_s:
        return []
    return [f"kvgate epp: warning: upstream.first_byte_timeout_s ({up.first_byte_timeout_s:g} s) "
            f"is not above upstream.idle_timeout_s ({up.idle_timeout_s:g} s): Envoy's per-try "
            "idle timeout (rendered from the first) resets a stalled stream before the picker "
            "ends it with its error event"]


def _check_free(host: str, port: int) -> None:
    """The gRPC port must be free (grpc binds it later, inside the start-up)."""
    if port != 0:
        bound_socket(host, Port(port, GRPC_PORT, " (gRPC)")).close()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = load(args)
        warning = check_secrets(cfg, epp_ports(cfg))
    except ConfigError as exc:
        print(f"kvgate epp: {exc.message}", file=sys.stderr)
        return 2
    assert cfg.server.admin_port is not None
    try:
        _check_free(cfg.server.host, cfg.epp.port)
        sockets = bind_sockets(cfg, [Port(cfg.server.admin_port, HTTP_PORT)])
    except ListenError as exc:
        print(f"kvgate epp: {exc.line()}", file=sys.stderr, flush=True)
        return 1
    say = start_output(cfg)  # with log_format json, as JSON log lines (as `kvgate serve`)
    for line in [*([warning] if warning else []), *start_warnings(cfg), *named_hosts(cfg),
                 *stall_cut_by_envoy(cfg)]:
        say(line)
    from gateway.epp.server import EppApp  # the protos load only here

    return run_server(cfg, "kvgate epp", app=EppApp(cfg), sockets=sockets,
                      line=listening_line(cfg))


def listening_line(cfg: KvgateConfig) -> str:
    """The picker binds no `server.port`: its line names the two ports it does serve."""
    host = f"[{cfg.server.host}]" if ":" in cfg.server.host else cfg.server.host
    return (f"listening on grpc {host}:{cfg.epp.port} (ext_proc, health), "
            f"http://{host}:{cfg.server.admin_port} (/metrics, /readyz, admin API)")
