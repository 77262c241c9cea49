"""`kvgate demo`: simulated vLLM pools behind the gateway, on loopback, in one command.

Two pools of two `kvgate sim` child processes each: 'fp8' (fast preset) and 'awq' (slower
preset), one public model name mapped per tier (the default tier goes to fp8). The gateway runs
in this process; once it is ready the base URL, an `openai` snippet and a curl line are printed.
Ctrl-C (or SIGTERM) stops the gateway gracefully, then the replicas.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from gateway.app import GatewayApp
from gateway.config import KvgateConfig, load_config
from gateway.errors import ConfigError
from gateway.serve import configure_logging, make_server

__all__ = ["main"]

PUBLIC_MODEL = "kvgate-demo"
POOLS = {  # pool -> (served model name, simulator preset)
    "fp8": ("demo-8b-fp8", "h100-8b-fp8"),
    "awq": ("demo-70b-awq", "a100-70b-awq"),
}
REPLICAS_PER_POOL = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_http(url: str, deadline: float, procs: list[subprocess.Popen[bytes]]) -> bool:
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def start_replicas(time_scale: float) -> tuple[list[subprocess.Popen[bytes]], dict[str, list[str]]]:
    procs: list[subprocess.Popen[bytes]] = []
    urls: dict[str, list[str]] = {}
    for pool, (served, preset) in POOLS.items():
        for _ in range(REPLICAS_PER_POOL):
            port = _free_port()
            cmd = [sys.executable, "-m", "gateway.cli", "sim", "--host", "127.0.0.1",
                   "--port", str(port), "--model", served, "--preset", preset,
                   "--time-scale", str(time_scale)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
            urls.setdefault(pool, []).append(f"http://127.0.0.1:{port}")
    return procs, urls


def stop_replicas(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def demo_config(urls: dict[str, list[str]], port: int) -> KvgateConfig:
    overrides: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": port, "shutdown_grace_s": 5},
        "pools": {pool: {"served_model": POOLS[pool][0], "replicas": urls[pool]}
                  for pool in POOLS},
        "models": {PUBLIC_MODEL: {"default": "fp8", "premium": "fp8", "free": "awq"}},
        "tiers": {"default": {}, "premium": {"priority": 0, "spill_to": "awq"},
                  "free": {"priority": 10}},
    }
    return load_config("", overrides=overrides)


def banner(base: str) -> str:
    return f"""
kvgate is up: {base}/v1   (pools fp8 and awq, 2 simulated replicas each)

  python - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{base}/v1", api_key="demo")
  r = client.chat.completions.create(
      model="{PUBLIC_MODEL}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(r.choices[0].message.content)
  EOF

  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{PUBLIC_MODEL}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  metrics: {base}/metrics    readiness: {base}/readyz    Ctrl-C stops everything.
"""


def _announce_when_ready(base: str) -> None:
    if _wait_http(f"{base}/readyz", time.monotonic() + 60, []):
        print(banner(base), flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvgate demo", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000, help="gateway port on 127.0.0.1")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="run the simulated engines this many times faster than real time")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    configure_logging(args.log_level)
    procs, urls = start_replicas(args.time_scale)
    try:
        deadline = time.monotonic() + 30
        for url in (u for pool in urls.values() for u in pool):
            if not _wait_http(f"{url}/health", deadline, procs):
                print("kvgate demo: a simulated replica did not start", file=sys.stderr)
                return 1
        try:
            cfg = demo_config(urls, args.port)
        except ConfigError as exc:
            print(f"kvgate demo: {exc.message}", file=sys.stderr)
            return 2
        base = f"http://127.0.0.1:{cfg.server.port}"
        threading.Thread(target=_announce_when_ready, args=(base,), daemon=True).start()
        server = make_server(GatewayApp(cfg))
        server.run()  # returns after Ctrl-C / SIGTERM and a graceful shutdown
        return 0 if server.started else 1
    finally:
        stop_replicas(procs)
        print("kvgate demo: stopped", file=sys.stderr)
