"""`kvgate serve`: load the configuration and run the gateway under uvicorn.

uvicorn with uvloop and httptools, no uvicorn access log (kvgate writes its own request line,
with the routing fields, at INFO: `--log-level warning` turns it off), TCP_NODELAY set on every
accepted socket (small SSE writes must not wait for delayed ACKs; uvloop already does it, this
keeps it true under any loop). SIGTERM/SIGINT stop accepting and let in-flight requests finish
for `server.shutdown_grace_s`. Logs are JSON lines unless `--log-format text`.

Authentication is on unless `--no-auth` (or ``tenancy.auth: false``): it needs the salt
secret (``KVGATE_SALT_SECRET`` or ``tenancy.salt_secret_file``), and without one the command
stops at once with a message saying so, before anything listens. Without authentication and
with no listen address given (`--host`, `server.host` in the file or `KVGATE_SERVER__HOST`),
the gateway binds 127.0.0.1 only; a given address wins, with a warning when it is reachable
from the network. The address bound is logged once the gateway serves (its start-up done):
`listening on http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import uvicorn

from gateway.app import GatewayApp
from gateway.cli.flags import PORT, WORKERS
from gateway.cli.overridden import flagged_server, overridden_invalid
from gateway.cli.parser import Parser
from gateway.config import (
    LOG_LEVELS,
    QUICK_SOURCE,
    KvgateConfig,
    auth_secret,
    discovery_problems,
    load_config,
    own_address_replicas,
    quick_unread_env,
    serve_ports,
    unknown_env,
)
from gateway.config.fair_ids import unknown_fairness_tenants
from gateway.config.spills import start_spill_warnings
from gateway.drain import KvgateServer, grace_timeout
from gateway.errors import ConfigError
from gateway.httpguard import HttpLimits, NoDelayHttpTools, guarded_protocol
from gateway.logs import JsonFormatter, configure_logging
from gateway.workers import WORKERS_NEED_REDIS, run_workers, workers_apart
from routing.policies import REGISTRY

__all__ = [
    "ADMIN_PORT", "API_PORT", "NO_AUTH_WARNING", "NoDelayHttpTools", "Port", "bind_sockets",
    "bound_socket", "build_parser", "check_secrets",
    "config_from_args", "configure_logging", "main", "make_server", "run_server",
    "with_bound_port",
]

NO_AUTH_WARNING = """
*** WARNING: kvgate runs WITHOUT AUTHENTICATION (--no-auth) ***
*** Every request is served as the single tenant 'default', with no API key, no per-tenant ***
*** limits or cache isolation. Use it only on a trusted network or loopback.             ***
"""

log = logging.getLogger(__name__)


def build_parser(prog: str = "kvgate serve") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description="Run the kvgate gateway.")
    p.add_argument("--config", help="YAML config file (default: $KVGATE_CONFIG)")
    p.add_argument("--upstream", action="append", metavar="URL",
                   help="a vLLM replica's address, e.g. http://10.0.0.1:8000, without /v1 "
                        "(repeat); one pool, its model name from /v1/models")
    p.add_argument("--policy", choices=sorted(REGISTRY), metavar="POLICY",
                   help=f"routing policy: {', '.join(sorted(REGISTRY))} (overrides "
                        "routing.policy; default cache_aware)")
    p.add_argument("--host", help="listen address (overrides server.host; default 0.0.0.0, "
                                  "127.0.0.1 with --no-auth)")
    p.add_argument("--port", type=PORT, help="listen port (overrides server.port; default 8000)")
    p.add_argument("--workers", type=WORKERS,
                   help="worker processes on the port, 1 to 64 (overrides server.workers; >1 "
                        "needs KVGATE_REDIS_URL)")
    p.add_argument("--log-level", type=str.lower, choices=LOG_LEVELS, metavar="LOG_LEVEL",
                   help=f"{', '.join(LOG_LEVELS)} (overrides server.log_level; default info)")
    p.add_argument("--log-format", choices=["json", "text"],
                   help="one JSON object per line or readable text (overrides "
                        "server.log_format; default json)")
    p.add_argument("--no-auth", action="store_true",
                   help="single tenant, no API keys (local use only: binds 127.0.0.1 unless "
                        "--host or server.host is given; says so loudly)")
    return p


def config_from_args(
    args: argparse.Namespace, extra: Mapping[str, Mapping[str, Any]] | None = None
) -> KvgateConfig:
    """The configuration with the flags applied (`extra`: more section overrides)."""
    overrides: dict[str, Any] = {}
    if args.upstream:
        if args.config:
            raise ConfigError("use either --config or --upstream, not both")
        overrides["pools"] = {"default": {"replicas": list(args.upstream)}}
        overrides["models"] = {}
    server = flagged_server(args)
    if server:
        overrides["server"] = server
    if args.policy:
        overrides["routing"] = {"policy": args.policy}
    if args.no_auth:
        overrides["tenancy"] = {"auth": False}
    for section, values in (extra or {}).items():
        overrides[section] = {**overrides.get(section, {}), **values}
    # --upstream replaces any file named by KVGATE_CONFIG: pass an empty path explicitly
    path = args.config if not args.upstream else ""
    return loopback_without_auth(load_config(path, overrides=overrides, quick=bool(args.upstream)))


LOOPBACK = "127.0.0.1"


def loopback_without_auth(cfg: KvgateConfig) -> KvgateConfig:
    """Without authentication and no listen address given (flag, file or env), 127.0.0.1."""
    if cfg.tenancy.auth or "host" in cfg.server.model_fields_set:
        return cfg
    return cfg.model_copy(update={"server": cfg.server.model_copy(update={"host": LOOPBACK})})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_secrets(cfg: KvgateConfig, ports: Mapping[int, str] | None = None) -> str | None:
    """Raise `ConfigError` when auth is on without a secret, a pool's `api_key_env` names
    a variable that is not set (vLLM would answer 401 to every request, while its /health,
    not behind the key, says the replica is fine), a pool follows Kubernetes with no API
    server to ask, or a replica is listed at one of the process's own `ports` (default
    `kvgate serve`'s); a warning to print, or None."""
    auth_secret(cfg)
    if loops := own_address_replicas(cfg, serve_ports(cfg) if ports is None else ports):
        raise ConfigError(loops[0])
    for name, pool in cfg.pools.items():
        if pool.api_key_env and not os.environ.get(pool.api_key_env):
            raise ConfigError(f"pools.{name}.api_key_env: the environment variable "
                              f"{pool.api_key_env} is not set (or empty)")
    if problems := discovery_problems(cfg):
        raise ConfigError(problems[0])
    return None if cfg.tenancy.auth else NO_AUTH_WARNING


def make_server(
    app: GatewayApp, on_started: Callable[[], None] | None = None
) -> KvgateServer:
    cfg = app.cfg.server
    protocol = guarded_protocol(http_limits(app.cfg))
    config = uvicorn.Config(
        app, host=cfg.host, port=cfg.port, loop="uvloop", http=protocol,
        lifespan="on", access_log=False, server_header=False, date_header=False,
        # no WebSocket route: an `Upgrade: websocket` request is answered as plain HTTP (with
        # the websockets library installed, uvicorn upgraded it, the app declined, and the
        # client got a text/plain 500)
        ws="none",
        proxy_headers=False,  # kvgate never reads the client address: skip the middleware
        timeout_graceful_shutdown=grace_timeout(cfg.shutdown_grace_s),
        timeout_keep_alive=cfg.keep_alive_timeout_s,
        log_level=cfg.log_level.lower(), log_config=None,
    )
    return KvgateServer(config, cfg.shutdown_grace_s, on_started)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(args)
        warning = check_secrets(cfg)  # fail now, with the reason, not inside the lifespan
    except ConfigError as exc:
        print(f"kvgate serve: {exc.message}", file=sys.stderr)
        return 2
    if cfg.server.workers > 1 and cfg.redis_url is None:
        print(f"kvgate serve: {WORKERS_NEED_REDIS}", file=sys.stderr)
        return 2
    try:  # first: a port in use is the one line printed
        sockets = bind_sockets(cfg)
    except ListenError as exc:
        print(f"kvgate serve: {exc.line()}", file=sys.stderr, flush=True)
        return 1
    cfg = with_bound_port(cfg, sockets[0])
    say = start_output(cfg)
    if warning:
        say(warning)
    if args.upstream and (path := os.environ.get("KVGATE_CONFIG")):
        say(f"kvgate serve: warning: --upstream is the quick form: the file KVGATE_CONFIG "
            f"names ({path}) is not read")
    for line in start_warnings(cfg):
        say(line)
    for line in overridden_invalid(args):
        say(f"kvgate serve: {line}")
    if cfg.server.workers > 1:
        configure_logging(cfg.server.log_level, cfg.server.log_format)
        # once, not once per worker, when every worker serves
        return run_workers(cfg, sockets, _serve_one, serving=lambda: log.info(listening(cfg)))
    return run_server(cfg, "kvgate serve", sockets=sockets)


def _serve_one(
    cfg: KvgateConfig, sockets: list[socket.socket], on_started: Callable[[], None]
) -> int:
    return run_server(cfg, "kvgate serve", sockets=sockets, on_started=on_started,
                      announce=False)


# -- listening, limits and start-up warnings (kept apart from the parsing above) ---------------
def http_limits(cfg: KvgateConfig) -> HttpLimits:
    server = cfg.server
    # a client gets as long to take an answer's buffered bytes as a stream's client a chunk
    return HttpLimits(max_header_bytes=server.max_header_bytes, max_headers=server.max_headers,
                      header_timeout_s=server.header_timeout_s,
                      body_timeout_s=server.body_timeout_s,
                      write_timeout_s=cfg.upstream.idle_timeout_s)


class ListenError(Exception):
    """A listen address could not be bound: the message says which and why, `hint` what to
    change (the flag or setting of the command that binds it; `line()` is both, the one line
    to print)."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint

    def line(self) -> str:
        return f"{self} ({self.hint})" if self.hint else str(self)


API_PORT = "another port with --port"  # where another port is chosen (`Port.setting`)
ADMIN_PORT = "another admin port in server.admin_port or KVGATE_SERVER__ADMIN_PORT"


class Port(NamedTuple):
    """A port to bind, and where another one is chosen when it cannot be had (the hint)."""

    number: int
    setting: str  # "" for a port the command chose itself (nothing to change)
    label: str = ""  # after the address in the message, e.g. " (gRPC)"


def _listen_hint(exc: OSError, setting: str) -> str:
    """What to change: the host when it is not this machine's (a port cannot help), the port
    (at `setting`: the refused port's own flag or setting) when it is taken or privileged;
    nothing for another error (its reason is all there is to say)."""
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return "choose another host with --host: an address of this machine, or 0.0.0.0 for all"
    if not setting:  # a port the command chose itself
        return ""
    if exc.errno == errno.EACCES:
        return f"ports below 1024 need privileges: choose {setting}"
    return f"choose {setting}" if exc.errno == errno.EADDRINUSE else ""


def bound_socket(host: str, port: Port) -> socket.socket:
    """A socket bound to `host` and `port` (not yet listening), or `ListenError` naming the
    address, why, and what to change (both edges' ports, `kvgate serve` and `kvgate epp`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port.number))
    except OSError as exc:
        sock.close()
        reason = (exc.strerror or str(exc)).lower()
        raise ListenError(f"cannot listen on {_hostport(host, port.number)}{port.label}: "
                          f"{reason}", _listen_hint(exc, port.setting)) from None
    return sock


def bind_sockets(cfg: KvgateConfig, ports: Sequence[Port] | None = None) -> list[socket.socket]:
    """Bind the API port (and the admin port), or `ports`, before anything starts, so a port
    in use is reported in one line before any start-up log. One server (one app, one
    lifespan) serves them all; the app tells the ports apart by each request's local port."""
    if ports is None:
        server = cfg.server
        ports = [Port(server.port, API_PORT)]
        if server.admin_port:  # (never the API port: the config refuses it)
            ports.append(Port(server.admin_port, ADMIN_PORT))
    socks: list[socket.socket] = []
    for port in ports:
        try:
            sock = bound_socket(cfg.server.host, port)
        except ListenError:
            for other in socks:
                other.close()
            raise
        sock.listen(2048)
        sock.set_inheritable(True)
        socks.append(sock)
    return socks


def with_bound_port(cfg: KvgateConfig, sock: socket.socket) -> KvgateConfig:
    """`cfg` with `server.port` 0 (any free port) replaced by the one `sock`, the API port's
    socket, was given: the listening line, and the app, name the port clients use."""
    if cfg.server.port != 0:
        return cfg
    port = sock.getsockname()[1]
    return cfg.model_copy(update={"server": cfg.server.model_copy(update={"port": port})})


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listening(cfg: KvgateConfig) -> str:
    """The start-up line naming what is bound: `listening on http://HOST:PORT` (+ admin)."""
    server = cfg.server
    line = f"listening on http://{_hostport(server.host, server.port)}"
    if server.admin_port:
        line += f", admin API on http://{_hostport(server.host, server.admin_port)}"
    return line


def run_server(
    cfg: KvgateConfig, prog: str, *, app: GatewayApp | None = None,
    sockets: list[socket.socket] | None = None, on_started: Callable[[], None] | None = None,
    announce: bool = True, line: str | None = None,
) -> int:
    """Bind (unless `sockets` are given), run until SIGTERM/SIGINT, shut down gracefully.
    `announce`: log the `listening on` line (`line`, else the gateway's ports) once the app
    has started and serves (a start that fails never said it listened), before
    `on_started`. 0 after a clean stop, 1 when it could not listen or start."""
    if sockets is None:
        try:
            sockets = bind_sockets(cfg)
        except ListenError as exc:
            print(f"{prog}: {exc.line()}", file=sys.stderr, flush=True)
            return 1
    configure_logging(cfg.server.log_level, cfg.server.log_format)
    said = line or listening(cfg)

    def started() -> None:
        if announce:
            log.info(said)
        if on_started is not None:
            on_started()

    server = make_server(app or GatewayApp(cfg), started)
    server.run(sockets=sockets)
    return 0 if server.started else 1


def start_output(cfg: KvgateConfig) -> Callable[[str], None]:
    """How a start-up warning is said: as written for a terminal, or with ``log_format: json``
    as a JSON log line (a log collector reads every stderr line as one; the banners' bare
    lines were not JSON)."""
    if cfg.server.log_format != "json":
        return lambda text: print(text, file=sys.stderr, flush=True)
    configure_logging(cfg.server.log_level, "json")
    formatter = JsonFormatter()

    def say(text: str) -> None:
        # formatted here, not passed through the root logger: its level (`--log-level
        # error`) dropped them, and the plain-text banners are written whatever it says
        record = log.makeRecord(log.name, logging.WARNING, __file__, 0,
                                " ".join(text.split()), (), None)
        print(formatter.format(record), file=sys.stderr, flush=True)

    return say


def start_warnings(cfg: KvgateConfig) -> list[str]:
    """Loud start-up warnings about a configuration that cannot work as intended."""
    out = []
    # with Redis, keys may come from another replica's admin API: only the in-memory store.
    # Tenants from the config get no keys: only the admin API issues them.
    if cfg.tenancy.auth and cfg.admin_token is None and not cfg.redis_url:
        out.append(NO_ADMIN_WARNING)
    if not cfg.tenancy.auth:
        if is_loopback(cfg.server.host):
            out.append(f"kvgate: without authentication, listening on {cfg.server.host} only "
                       "(this machine); give --host (or server.host) to listen elsewhere")
        else:
            out.append(NETWORK_NO_AUTH_WARNING.format(host=cfg.server.host))
    if (apart := workers_apart(cfg)) is not None:
        out.append(f"kvgate: warning: {apart}")
    if cfg.source == QUICK_SOURCE:
        out += quick_unread_env()
    out += [f"kvgate: warning: {line}" for line in unknown_fairness_tenants(cfg)]
    out += [f"kvgate: warning: {line}" for line in start_spill_warnings(cfg)]
    return out + unknown_env(cfg)


NO_ADMIN_WARNING = """
*** WARNING: authentication is on, but KVGATE_ADMIN_TOKEN is not set and no Redis store is  ***
*** shared with another gateway: the admin API is disabled and nobody can create an API key, ***
*** so every request will get 401 (tenants in the config file get no keys either). Set      ***
*** KVGATE_ADMIN_TOKEN, then `kvgate admin tenants create ID` and `kvgate admin keys create ID`.
"""

NETWORK_NO_AUTH_WARNING = """
*** WARNING: an unauthenticated gateway is reachable from the network: it listens on {host}
*** without authentication, so anyone who can reach this machine can use it. Bind 127.0.0.1
*** (drop --host / server.host) or turn authentication on.
"""
