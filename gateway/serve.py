"""`kvgate serve`: load the configuration and run the gateway under uvicorn.

uvicorn with uvloop and httptools, no uvicorn access log (kvgate writes its own request line,
with the routing fields, at INFO: `--log-level warning` turns it off), TCP_NODELAY set on every
accepted socket (small SSE writes must not wait for delayed ACKs; uvloop already does it, this
keeps it true under any loop). SIGTERM/SIGINT stop accepting and let in-flight requests finish
for `server.shutdown_grace_s`. Logs are JSON lines unless `--log-format text`.

Authentication is on unless `--no-auth` (or ``tenancy.auth: false``): it needs the salt
secret (``KVGATE_SALT_SECRET`` or ``tenancy.salt_secret_file``), and without one the command
stops at once with a message saying so, before anything listens. One exception: a gateway
bound only to a loopback address (unreachable from other machines, e.g. local benchmarks and
`kvgate replay --spawn`) runs as if `--no-auth`, with the same loud warning.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import socket
import sys
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.app import GatewayApp
from gateway.config import KvgateConfig, auth_secret, load_config
from gateway.errors import ConfigError
from gateway.logs import configure_logging

__all__ = [
    "NO_AUTH_WARNING", "build_parser", "check_auth", "config_from_args", "configure_logging",
    "main", "make_server",
]

NO_AUTH_WARNING = """
*** WARNING: kvgate runs WITHOUT AUTHENTICATION (--no-auth) ***
*** Every request is served as the single tenant 'default', with no API key, no per-tenant ***
*** limits or cache isolation. Use it only on a trusted network or loopback.             ***
"""

log = logging.getLogger(__name__)


class NoDelayHttpTools(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # OSError: not a TCP socket (e.g. a unix socket)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


def build_parser(prog: str = "kvgate serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run the kvgate gateway.")
    p.add_argument("--config", help="YAML config file (default: $KVGATE_CONFIG)")
    p.add_argument("--upstream", action="append", metavar="URL",
                   help="a vLLM replica base URL (repeat); one pool, names from /v1/models")
    p.add_argument("--policy", help="routing policy (overrides routing.policy)")
    p.add_argument("--host", help="listen address (overrides server.host)")
    p.add_argument("--port", type=int, help="listen port (overrides server.port)")
    p.add_argument("--log-level", help="debug, info, warning, error")
    p.add_argument("--log-format", choices=["json", "text"],
                   help="one JSON object per line or readable text (overrides server.log_format)")
    p.add_argument("--no-auth", action="store_true",
                   help="single tenant, no API keys (local use only; says so loudly)")
    return p


def config_from_args(args: argparse.Namespace) -> KvgateConfig:
    overrides: dict[str, Any] = {}
    if args.upstream:
        if args.config:
            raise ConfigError("use either --config or --upstream, not both")
        overrides["pools"] = {"default": {"replicas": list(args.upstream)}}
        overrides["models"] = {}
    server: dict[str, Any] = {}
    if args.host:
        server["host"] = args.host
    if args.port is not None:
        server["port"] = args.port
    if args.log_level:
        server["log_level"] = args.log_level
    if args.log_format:
        server["log_format"] = args.log_format
    if server:
        overrides["server"] = server
    if args.policy:
        overrides["routing"] = {"policy": args.policy}
    if args.no_auth:
        overrides["tenancy"] = {"auth": False}
    # --upstream replaces any file named by KVGATE_CONFIG: pass an empty path explicitly
    path = args.config if not args.upstream else ""
    return load_config(path, overrides=overrides, quick=bool(args.upstream))


def check_auth(cfg: KvgateConfig) -> str | None:
    """Raise `ConfigError` when auth is on without a secret; a warning to print, or None."""
    auth_secret(cfg)
    return None if cfg.tenancy.auth else NO_AUTH_WARNING


def make_server(app: GatewayApp) -> uvicorn.Server:
    cfg = app.cfg.server
    config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, loop="uvloop", http=NoDelayHttpTools,
        lifespan="on", access_log=False, server_header=False, date_header=False,
        proxy_headers=False,  # kvgate never reads the client address: skip the middleware
        timeout_graceful_shutdown=math.ceil(cfg.shutdown_grace_s), log_level=cfg.log_level.lower(),
        log_config=None,
    )
    return uvicorn.Server(config)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        warning = check_auth(cfg)  # fail now, with the reason, not inside the lifespan
    except ConfigError as exc:
        print(f"kvgate serve: {exc.message}", file=sys.stderr)
        return 2
    if warning:
        print(warning, file=sys.stderr, flush=True)
    configure_logging(cfg.server.log_level, cfg.server.log_format)
    server = make_server(GatewayApp(cfg))
    server.run(sockets=listen_sockets(cfg) if cfg.server.admin_port else None)
    return 0 if server.started else 1


def listen_sockets(cfg: KvgateConfig) -> list[socket.socket]:
    """The API port and the admin port, served by one server (one app, one lifespan); the
    app tells them apart by the local port of each request."""
    socks = []
    for port in (cfg.server.port, cfg.server.admin_port):
        family = socket.AF_INET6 if ":" in cfg.server.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.server.host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
        socks.append(sock)
    return socks
