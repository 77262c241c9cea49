"""How often active health ejects a saturated replica (issue 15, item 2).

    python -m loadtest.bench_health [--delay 1.5] [--probes 20]

vLLM answers ``/health`` on the event loop that serves its requests, so a saturated replica
answers it late. This runs kvgate's `HealthMonitor`, with the default ``health`` settings of
the source tree it is imported from, against a loopback replica whose ``/health`` answers 200
after ``--delay`` seconds, for ``--probes`` probes (the clock advances one ``interval_s`` per
probe), and prints how many times the replica was ejected and for how many probes it stayed
out. Run it with ``PYTHONPATH=<an older source tree>`` to measure "before".
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

from gateway.config import KvgateConfig
from gateway.health import HealthMonitor
from gateway.pool import Pools
from loadtest.fleet import free_port

__all__ = ["main"]


async def _run(delay_s: float, probes: int) -> str:
    async def health(request: web.Request) -> web.Response:
        await asyncio.sleep(delay_s)
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    cfg = KvgateConfig.model_validate(
        {"pools": {"p": {"served_model": "m", "replicas": [f"http://127.0.0.1:{port}"]}}})
    pools = Pools(cfg)
    replica = pools.by_name["p"].replicas[0]
    now = [0.0]
    monitor = HealthMonitor(pools, cfg.health, lambda: now[0])
    ejections = out = 0
    try:
        for _ in range(probes):
            before = replica.state
            await monitor.poll_once()
            ejections += before != "ejected" and replica.state == "ejected"
            out += replica.state == "ejected"
            now[0] += cfg.health.interval_s
    finally:
        await pools.close()
        await runner.cleanup()
    return (f"health.timeout_s={cfg.health.timeout_s} /health answering in {delay_s} s, "
            f"{probes} probes: ejections={ejections}, probes spent ejected={out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_health", description=__doc__)
    p.add_argument("--delay", type=float, default=1.5, help="seconds /health takes to answer")
    p.add_argument("--probes", type=int, default=20)
    args = p.parse_args(argv)
    print(asyncio.run(_run(args.delay, args.probes)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
