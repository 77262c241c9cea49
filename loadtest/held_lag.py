"""How late a peer's pick reaches a gateway live, the figure the held picks' window stands for
(`Router.defer_s`: rank r holds a contested pick r windows, the window being how late a pick of
the same instant by a lower rank is applied here).

    python -m loadtest.held_lag [--gateways N] [--flush-ms 5,10,20] [--rounds R]
                                [--seconds S] [--rate Q] [--burst K]

N routers in one process, each with its real `RouteSync` over one real redis-server of its
own; a background load of Q requests/s spread over them (the `sync_cost` conversations, each in
flight 100 ms: the publishers tick and read once per interval, as a busy gateway's do), and
every 100 ms a burst: each router picks K new prompts at the same instant. For each route of a
burst, the time from its pick to its application by each peer (``pick->apply``), and the
apply lag the gateways report (`SyncStats.lag`: written to Redis -> applied, Redis's clock);
the process's CPU per routed request and Redis commands per second. Flush intervals alternate
in each round (a shared machine's drift hits each alike)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.fleet.sync import RouteSync, SyncSettings
from loadtest.sync_cost import _Own, _workload
from routing.peers import RouteRecord
from routing.router import Router, RouterConfig
from routing.types import RequestFeatures

__all__ = ["Lag", "measure"]

BURST_EVERY_S = 0.1


@dataclass
class Lag:
    flush_ms: float
    bursts: int
    pick_apply_p50_ms: float
    pick_apply_p99_ms: float
    pick_apply_max_ms: float
    apply_lag_p50_ms: float  # SyncStats: written to Redis -> applied
    apply_lag_p99_ms: float
    cpu_us: float  # the process's CPU per routed request
    redis_cmds_per_s: float
    requests: int


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))] * 1e3 if xs else float("nan")


async def measure(url: str, gateways: int, flush_s: float, seconds: float, rate: float,
                  burst: int, seed: int = 7) -> Lag:
    rng = random.Random(seed)
    owns = [_Own(Router(RouterConfig())) for _ in range(gateways)]
    picked: dict[int, float] = {}  # a burst route's last block -> its pick time
    lags: list[float] = []

    def watch(router: Router) -> None:
        apply = router.apply_peer_routes

        def applied(records: Sequence[RouteRecord], member: str, now: float,
                    live: bool = True) -> None:
            t = time.monotonic()
            for r in records:
                at = picked.get(r.hashes[-1]) if r.hashes else None
                if at is not None:
                    lags.append(t - at)
            apply(records, member, now, live)

        router.apply_peer_routes = applied  # type: ignore[method-assign]

    admin = aioredis.Redis.from_url(url)
    await admin.flushall()
    settings = SyncSettings(flush_interval_s=flush_s, catchup_entries=0)
    syncs = []
    for i, own in enumerate(owns):
        watch(own.router)
        syncs.append(RouteSync(own.router, url, "held", settings,
                               own_loads=lambda own=own: own.loads,  # type: ignore[misc]
                               known=lambda r: True, clock=time.monotonic, member=f"gw{i}"))
    for s in syncs:
        await s.start()
    await asyncio.sleep(0.1)
    n = int(rate * seconds)
    background = _workload(rng, n)
    cmds0 = int((await admin.info("stats"))["total_commands_processed"])
    t0, c0 = time.perf_counter(), time.process_time()
    routed, bursts, next_burst, i = 0, 0, t0 + BURST_EVERY_S, 0
    step = 0.005
    while time.perf_counter() - t0 < seconds:
        now = time.perf_counter()
        due = min(n, int((now - t0) * rate))
        while i < due:  # the background load, spread over the routers
            owns[i % gateways].route(background[i], time.monotonic())
            i += 1
            routed += 1
        if now >= next_burst:  # every router picks `burst` new prompts at this instant
            next_burst += BURST_EVERY_S
            bursts += 1
            for own in owns:
                for _ in range(burst):
                    hashes = tuple(rng.getrandbits(63) for _ in range(24))
                    picked[hashes[-1]] = time.monotonic()
                    own.route(RequestFeatures(model="m", block_hashes=hashes,
                                              prompt_tokens=24 * 16),
                              time.monotonic())
                    routed += 1
        await asyncio.sleep(step)
    await asyncio.sleep(max(0.2, 4 * flush_s))  # the last batches are applied
    cpu = time.process_time() - c0
    elapsed = time.perf_counter() - t0
    cmds = int((await admin.info("stats"))["total_commands_processed"]) - cmds0
    applied = [x for s in syncs for x in s.stats.recent_lags]
    for s in syncs:
        await s.stop()
    await admin.aclose()
    return Lag(flush_ms=flush_s * 1e3, bursts=bursts,
               pick_apply_p50_ms=statistics.median(lags) * 1e3 if lags else float("nan"),
               pick_apply_p99_ms=_pct(lags, 0.99), pick_apply_max_ms=_pct(lags, 1.0),
               apply_lag_p50_ms=statistics.median(applied) * 1e3 if applied else float("nan"),
               apply_lag_p99_ms=_pct(applied, 0.99), cpu_us=cpu / max(routed, 1) * 1e6,
               redis_cmds_per_s=cmds / elapsed, requests=routed)


def _row(m: Lag) -> str:
    return (f"flush {m.flush_ms:4.0f} ms: pick->apply p50 {m.pick_apply_p50_ms:6.2f} p99 "
            f"{m.pick_apply_p99_ms:6.2f} max {m.pick_apply_max_ms:6.2f} ms; apply lag p50 "
            f"{m.apply_lag_p50_ms:6.2f} p99 {m.apply_lag_p99_ms:6.2f} ms; "
            f"{m.cpu_us:6.1f} us/request, {m.redis_cmds_per_s:5.0f} Redis cmds/s, "
            f"{m.requests} requests, {m.bursts} bursts")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from loadtest.bench_sync import redis_server

    p = argparse.ArgumentParser(prog="python -m loadtest.held_lag", description=__doc__)
    p.add_argument("--gateways", type=int, default=4, help="routers (default 4)")
    p.add_argument("--flush-ms", default="5,10,20",
                   help="flush intervals to compare, ms, comma-separated (default 5,10,20)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds over every interval (default 2; medians over them)")
    p.add_argument("--seconds", type=float, default=4.0,
                   help="length of one run, s (default 4)")
    p.add_argument("--rate", type=float, default=400.0, help="background requests/s (default 400)")
    p.add_argument("--burst", type=int, default=2, help="picks per router per burst (default 2)")
    args = p.parse_args(argv)
    flushes = [float(x) / 1000 for x in args.flush_ms.split(",")]
    runs: dict[float, list[Lag]] = {w: [] for w in flushes}
    with redis_server() as url:
        for r in range(args.rounds):
            for w in flushes:
                got = asyncio.run(measure(url, args.gateways, w, args.seconds, args.rate,
                                          args.burst, seed=7 + r))
                runs[w].append(got)
                print(f"round {r} {_row(got)}", flush=True)
    print("medians:")
    for w, each in runs.items():
        numbers = {k: statistics.median(getattr(x, k) for x in each) for k in _NUMBERS}
        med = Lag(flush_ms=w * 1e3, bursts=each[0].bursts, requests=each[0].requests, **numbers)
        print(f"  {_row(med)}")
    return 0


_NUMBERS = ("pick_apply_p50_ms", "pick_apply_p99_ms", "pick_apply_max_ms", "apply_lag_p50_ms",
            "apply_lag_p99_ms", "cpu_us", "redis_cmds_per_s")

if __name__ == "__main__":
    raise SystemExit(main())
