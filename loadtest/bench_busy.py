"""A replica that answers "busy" must not attract the traffic (issue 10, faults 1).

    python -m loadtest.bench_busy [--requests 1500] [--concurrency 32] [--policy all]
                                  [--scenario busy|error500] [--source DIR] [--json FILE]

Three simulated replicas behind one kvgate; one of them runs with vLLM's
``--max-num-queued-reqs 2``, so it answers 503 "The engine is currently busy ..." at once when
two requests are already there. A closed loop of `--concurrency` clients sends `--requests`
non-streamed completions per policy; the table shows per policy how many failed (any status
but 200), how many requests the busy replica served, and the gateway's retries. The target is
<= 1 % failed for every policy. ``--scenario error500`` instead gives that replica vLLM's
500 on 30 % of its requests (issue 10, faults 7: a 500 before the first byte is retried).

``--source DIR`` runs the gateway (and simulators) from another source tree, e.g. an export of
an older commit (``git archive <commit> | tar -x -C DIR``), to measure "before" with the same
script. Results go to stdout (and ``--json FILE``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

from loadtest.fleet import free_port, wait_http

__all__ = ["main"]

MODEL = "bench-model"
POLICIES = ("round_robin", "least_load", "consistent_hash", "cache_aware")


class Procs:
    def __init__(self, source: Path) -> None:
        self.source = source
        self.env = {**os.environ, "PYTHONPATH": str(source)}
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], probe: str) -> None:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], cwd=self.source,
                                env=self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        if not wait_http(probe, 60):
            raise RuntimeError(f"not ready: {probe}")

    def sim(self, *extra: str) -> str:
        port = free_port()
        self.start(["sim", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
                    *extra], f"http://127.0.0.1:{port}/health")
        return f"http://127.0.0.1:{port}"

    def gateway(self, upstreams: list[str], policy: str) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        ups = [a for u in upstreams for a in ("--upstream", u)]
        self.start(["serve", "--no-auth", "--host", "127.0.0.1", "--port", str(port),
                    "--policy", policy, "--log-level", "warning", *ups],
                   f"http://127.0.0.1:{port}/readyz")
        return f"http://127.0.0.1:{port}", self.procs[-1]

    def stop(self, proc: subprocess.Popen[bytes] | None = None) -> None:
        for p in [proc] if proc is not None else list(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            self.procs.remove(p)


async def _load(base: str, requests: int, concurrency: int) -> tuple[Counter[str], Counter[int]]:
    replicas: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    todo = iter(range(requests))
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def worker() -> None:
            for i in todo:
                body = {"model": MODEL, "max_tokens": 16, "ignore_eos": True,
                        "prompt": f"conversation {i % 97}: " + "tell me more. " * 20}
                try:
                    async with session.post(f"{base}/v1/completions", json=body) as resp:
                        await resp.read()
                        statuses[resp.status] += 1
                        if resp.status == 200:
                            replicas[resp.headers.get("x-kvgate-replica", "?")] += 1
                except (aiohttp.ClientError, TimeoutError):
                    statuses[0] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return replicas, statuses


def _retries(base: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r"^kvgate_upstream_retries_total\{[^}]*\} (\S+)$", text, re.M))


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    procs = Procs(Path(args.source).resolve())
    rows: list[dict[str, object]] = []
    try:
        scale = ["--time-scale", str(args.time_scale)]
        fault = (["--max-num-queued-reqs", "2"] if args.scenario == "busy"
                 else ["--error-rate", "0.3", "--error-status", "500", "--seed", "1"])
        busy = procs.sim(*scale, *fault)
        free = [procs.sim(*scale) for _ in range(2)]
        for policy in args.policies:
            base, gw = procs.gateway([busy, *free], policy)
            t0 = time.monotonic()
            replicas, statuses = asyncio.run(_load(base, args.requests, args.concurrency))
            wall = time.monotonic() - t0
            failed = args.requests - statuses[200]
            on_busy = sum(n for r, n in replicas.items() if r.endswith(busy[7:]))
            rows.append({"policy": policy, "requests": args.requests, "failed": failed,
                         "failed_pct": round(100.0 * failed / args.requests, 2),
                         "served_by_busy_replica": on_busy, "retries": _retries(base),
                         "statuses": {str(k): v for k, v in sorted(statuses.items())},
                         "wall_s": round(wall, 1)})
            procs.stop(gw)
    finally:
        procs.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_busy", description=__doc__)
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--policy", default="all", help="one policy or 'all'")
    p.add_argument("--scenario", choices=["busy", "error500"], default="busy")
    p.add_argument("--source", default=str(Path(__file__).resolve().parents[1]),
                   help="source tree to run kvgate from (default: this one)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    args.policies = POLICIES if args.policy == "all" else (args.policy,)
    rows = run(args)
    print(f"{'policy':<16} {'failed':>7} {'failed %':>9} {'on it':>8} {'retries':>8}  statuses")
    for r in rows:
        print(f"{r['policy']:<16} {r['failed']:>7} {r['failed_pct']:>9} "
              f"{r['served_by_busy_replica']:>8} {r['retries']:>8.0f}  {r['statuses']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    worst = max(float(str(r["failed_pct"])) for r in rows)
    return 0 if worst <= 1.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
