"""How late a peer's pick reaches a gateway live, the figure the held picks' window stands for
(`Router.defer_s`: rank r holds a contested pick r hold windows, the hold window being how late
a pick of the same instant by a lower rank is applied here), and whether it is long enough.

    python -m loadtest.held_lag [--gateways N] [--flush-ms 5,10,20] [--hold-ms 10,20]
                                [--rounds R] [--seconds S] [--rate Q] [--burst K]

N routers in one process, each with its real `RouteSync` over one real redis-server, picks held
as a gateway holds them (`sync.hold_picks`); a background load of Q requests/s spread over them
(the `sync_cost` conversations, each in flight 100 ms: the publishers tick and read once per
interval, as a busy gateway's do), and every 100 ms a burst: each router gets K new prompts at
the same instant and, as `Preparer` does, picks each at once or holds it `defer_s` (then says
so: `Router.holding`). For each route of a burst, the time from its pick to its application by
each peer (``pick->apply``), and by each higher-ranked peer (the ones that may hold for it);
the share of the lower ranks' burst picks applied before a held pick of the same burst was
made (``seen``) and the mean hold; the apply lag the gateways report (`SyncStats.lag`: written
to Redis -> applied, Redis's clock); the process's CPU per routed request and Redis commands
per second. Settings alternate in each round (a shared machine's drift hits each alike). One
process for all routers: each one's work delays the others' (a gateway has a process of its
own), so the tails are longer than a fleet's."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import nan

import redis.asyncio as aioredis

from gateway.fleet.settings import SyncSettings
from gateway.fleet.sync import RouteSync
from loadtest.sync_cost import _Own, _workload
from routing.peers import RouteRecord
from routing.router import Router, RouterConfig
from routing.types import RequestFeatures

__all__ = ["Lag", "measure"]

BURST_EVERY_S = 0.1


@dataclass
class Lag:
    flush_ms: float
    hold_ms_set: float  # sync.hold_window_ms (nan: the tree has none)
    bursts: int
    pick_apply_p50_ms: float  # a burst pick -> applied by each peer
    pick_apply_p99_ms: float
    pick_apply_max_ms: float
    up_p50_ms: float  # ... by each higher-ranked peer (the ones that may hold for it)
    up_p99_ms: float
    up_max_ms: float
    seen: float  # share of the lower ranks' burst picks applied before a held pick of it
    held: int  # held picks
    hold_ms: float  # the mean hold
    apply_lag_p50_ms: float  # SyncStats: written to Redis -> applied
    apply_lag_p99_ms: float
    cpu_us: float  # the process's CPU per routed request
    redis_cmds_per_s: float
    requests: int


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))] * 1e3 if xs else float("nan")


@dataclass
class _Burst:
    """The picks of one burst: (rank, last block) of each, and the held ones' (rank, time)."""

    picks: list[tuple[int, int]]
    held: list[tuple[int, float]]


async def measure(url: str, gateways: int, flush_s: float, seconds: float, rate: float,
                  burst: int, seed: int = 7, hold_s: float | None = None) -> Lag:
    rng = random.Random(seed)
    owns = [_Own(Router(RouterConfig())) for _ in range(gateways)]
    picked: dict[int, tuple[float, int]] = {}  # a burst route's last block -> (pick time, rank)
    applied: list[dict[int, float]] = [{} for _ in owns]  # per rank: last block -> applied at
    lags: list[float] = []
    up: list[float] = []  # applied by a higher rank

    def watch(rank: int, router: Router) -> None:
        apply, seen = router.apply_peer_routes, applied[rank]

        def applied_here(records: Sequence[RouteRecord], member: str, now: float,
                         live: bool = True) -> None:
            t = time.monotonic()
            for r in records:
                at = picked.get(r.hashes[-1]) if r.hashes else None
                if at is not None:
                    lags.append(t - at[0])
                    if at[1] < rank:
                        up.append(t - at[0])
                    seen[r.hashes[-1]] = t
            apply(records, member, now, live)

        router.apply_peer_routes = applied_here  # type: ignore[method-assign]

    admin = aioredis.Redis.from_url(url)
    await admin.flushall()
    # the live default: contested picks in a burst are held (`Router.defer_s`)
    settings = SyncSettings(flush_interval_s=flush_s, catchup_entries=0, defer=True)
    if hold_s is not None and hasattr(settings, "hold_window_s"):  # (not on older trees)
        settings = replace(settings, hold_window_s=hold_s)
    syncs = []
    for i, own in enumerate(owns):  # member gw<i> is rank i
        watch(i, own.router)
        syncs.append(RouteSync(own.router, url, "held", settings,
                               own_loads=lambda own=own: own.loads,  # type: ignore[misc]
                               known=lambda r: True, clock=time.monotonic, member=f"gw{i}"))
    for s in syncs:
        await s.start()
    await asyncio.sleep(0.1)
    n = int(rate * seconds)
    background = _workload(rng, n)
    bursts: list[_Burst] = []
    holds: list[float] = []
    tasks: set[asyncio.Task[None]] = set()

    def pick(rank: int, f: RequestFeatures, b: _Burst, held: bool) -> None:
        now = time.monotonic()
        picked[f.block_hashes[-1]] = (now, rank)
        b.picks.append((rank, f.block_hashes[-1]))
        if held:
            b.held.append((rank, now))
        owns[rank].route(f, now, held=held)

    async def hold(rank: int, f: RequestFeatures, b: _Burst, wait: float) -> None:
        await asyncio.sleep(wait)
        pick(rank, f, b, True)

    cmds0 = int((await admin.info("stats"))["total_commands_processed"])
    t0, c0 = time.perf_counter(), time.process_time()
    routed, next_burst, i = 0, t0 + BURST_EVERY_S, 0
    step = 0.005
    while time.perf_counter() - t0 < seconds:
        now = time.perf_counter()
        due = min(n, int((now - t0) * rate))
        while i < due:  # the background load, spread over the routers
            owns[i % gateways].route(background[i], time.monotonic())
            i += 1
            routed += 1
        if now >= next_burst:  # every router gets `burst` new prompts at this instant
            next_burst += BURST_EVERY_S
            b = _Burst([], [])
            bursts.append(b)
            for rank, own in enumerate(owns):
                for _ in range(burst):
                    hashes = tuple(rng.getrandbits(63) for _ in range(24))
                    f = RequestFeatures(model="m", block_hashes=hashes, prompt_tokens=24 * 16)
                    at = time.monotonic()
                    wait = own.router.defer_s(f, list(own.views.values()), at)
                    routed += 1
                    if wait <= 0.0:
                        pick(rank, f, b, False)
                        continue
                    holds.append(wait)
                    holding = getattr(own.router, "holding", None)  # (not on older trees)
                    if holding is not None:
                        holding(at + wait)
                    task = asyncio.create_task(hold(rank, f, b, wait))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
        await asyncio.sleep(step)
    await asyncio.sleep(max(0.3, 8 * flush_s))  # the held picks are made, the last applied
    cpu = time.process_time() - c0
    elapsed = time.perf_counter() - t0
    cmds = int((await admin.info("stats"))["total_commands_processed"]) - cmds0
    apply_lags = [x for s in syncs for x in s.stats.recent_lags]
    for s in syncs:
        await s.stop()
    await admin.aclose()
    pairs = [applied[rank].get(h, float("inf")) <= t
             for b in bursts for rank, t in b.held for r, h in b.picks if r < rank]
    return Lag(flush_ms=flush_s * 1e3, hold_ms_set=getattr(settings, "hold_window_s", nan) * 1e3,
               bursts=len(bursts),
               pick_apply_p50_ms=statistics.median(lags) * 1e3 if lags else float("nan"),
               pick_apply_p99_ms=_pct(lags, 0.99), pick_apply_max_ms=_pct(lags, 1.0),
               up_p50_ms=statistics.median(up) * 1e3 if up else float("nan"),
               up_p99_ms=_pct(up, 0.99), up_max_ms=_pct(up, 1.0),
               seen=sum(pairs) / len(pairs) if pairs else float("nan"), held=len(holds),
               hold_ms=statistics.fmean(holds) * 1e3 if holds else 0.0,
               apply_lag_p50_ms=(statistics.median(apply_lags) * 1e3 if apply_lags
                                 else float("nan")),
               apply_lag_p99_ms=_pct(apply_lags, 0.99), cpu_us=cpu / max(routed, 1) * 1e6,
               redis_cmds_per_s=cmds / elapsed, requests=routed)


def _row(m: Lag) -> str:
    return (f"flush {m.flush_ms:4.0f} ms, hold window {m.hold_ms_set:4.0f} ms: pick->apply p50 "
            f"{m.pick_apply_p50_ms:6.2f} p99 {m.pick_apply_p99_ms:6.2f} max "
            f"{m.pick_apply_max_ms:6.2f} ms; at a higher rank "
            f"p50 {m.up_p50_ms:6.2f} p99 {m.up_p99_ms:6.2f} max {m.up_max_ms:6.2f} ms; "
            f"{m.held} held {m.hold_ms:5.1f} ms on average, seen {m.seen:.3f}; apply lag p50 "
            f"{m.apply_lag_p50_ms:6.2f} p99 {m.apply_lag_p99_ms:6.2f} ms; "
            f"{m.cpu_us:6.1f} us/request, {m.redis_cmds_per_s:5.0f} Redis cmds/s, "
            f"{m.requests} requests, {m.bursts} bursts")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from loadtest.fleet import redis_server

    p = argparse.ArgumentParser(prog="python -m loadtest.held_lag", description=__doc__)
    p.add_argument("--gateways", type=int, default=4, help="routers (default 4)")
    p.add_argument("--flush-ms", default="5,10,20",
                   help="flush intervals to compare, ms, comma-separated (default 5,10,20)")
    p.add_argument("--hold-ms", default="",
                   help="hold windows to compare, ms, comma-separated (sync.hold_window_ms; "
                        "default: the setting's default)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds over every interval (default 2; medians over them)")
    p.add_argument("--seconds", type=float, default=4.0,
                   help="length of one run, s (default 4)")
    p.add_argument("--rate", type=float, default=400.0, help="background requests/s (default 400)")
    p.add_argument("--burst", type=int, default=2, help="picks per router per burst (default 2)")
    args = p.parse_args(argv)
    holds = [float(x) / 1000 for x in args.hold_ms.split(",")] if args.hold_ms else [None]
    runs: dict[tuple[float, float | None], list[Lag]] = {
        (float(w) / 1000, h): [] for w in args.flush_ms.split(",") for h in holds}
    with redis_server() as url:
        for r in range(args.rounds):
            for w, h in runs:
                got = asyncio.run(measure(url, args.gateways, w, args.seconds, args.rate,
                                          args.burst, seed=7 + r, hold_s=h))
                runs[w, h].append(got)
                print(f"round {r} {_row(got)}", flush=True)
    print("medians:")
    for each in runs.values():
        numbers = {k: statistics.median(getattr(x, k) for x in each) for k in _NUMBERS}
        med = Lag(flush_ms=each[0].flush_ms, hold_ms_set=each[0].hold_ms_set,
                  bursts=each[0].bursts, held=each[0].held, requests=each[0].requests,
                  **numbers)
        print(f"  {_row(med)}")
    return 0


_NUMBERS = ("pick_apply_p50_ms", "pick_apply_p99_ms", "pick_apply_max_ms", "up_p50_ms",
            "up_p99_ms", "up_max_ms", "seen", "hold_ms", "apply_lag_p50_ms", "apply_lag_p99_ms",
            "cpu_us", "redis_cmds_per_s")

if __name__ == "__main__":
    raise SystemExit(main())
