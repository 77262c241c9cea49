"""Live measurements behind `loadtest.bench_sync`: the CPU and bytes of sharing routing state,
Streams (what kvgate uses) vs pub/sub (the alternative), and gateway workers.

    python -m loadtest.sync_cost [--rounds R] [--seconds S] [--modes off,streams,pubsub]
                                 [--flush-ms W] [--hold-picks] [--step K] [--rate R]
                                 [--stickiness] [--simulate N]

runs the cost measurement alone (interleaved rounds, medians), e.g. to compare two trees or
flush intervals (``--step 1 --hold-picks``: requests one by one, contested picks' routes
urgent, and the Redis commands they cost); ``--stickiness`` checks conversation stickiness
across the two routers; ``--simulate N`` runs the same traffic in simulated time without
Redis (deterministic: count its instructions under callgrind at two sizes N, sharing off and
on, to compare two trees)."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, replace

import redis.asyncio as aioredis

from gateway.fleet.records import decode, encode
from gateway.fleet.settings import SyncSettings
from gateway.fleet.sync import RouteSync
from loadtest.fleet import free_port, wait_http
from routing.peers import ReplicaLoad
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

__all__ = ["Measured", "measure", "workers_run"]

RATE = 2000.0  # routed requests per second, over both routers
REPLICAS = [f"10.0.0.{i}:8000" for i in range(8)]
VIEWS = [ReplicaView(id=r, pool="p") for r in REPLICAS]
CONVERSATIONS = 400
SYSTEM_PROMPTS, SYSTEM_BLOCKS = 16, 8
TURNS, TURN_BLOCKS = 6, 4
HOLD_S = 0.1  # a request's time in flight (so ~25 in flight per replica at RATE)
PREFILL_S = 0.02  # of which awaiting its first token
KVGATE = [sys.executable, "-m", "gateway.cli"]


@dataclass
class Measured:
    mode: str
    requests: int
    cpu_us: float  # the whole process's CPU per routed request
    route_cpu_us: float  # of which pick + record_route
    bytes_per_request: float  # Redis network input (commands: XADD, XREAD)
    bytes_out_per_request: float  # Redis network output (replies: the entries read)
    batches_per_s: float  # XADDs (stream entries written)
    commands_per_s: float  # every Redis command (XADD, XREAD, ...), from its commandstats
    lag_p50_ms: float
    lag_p99_ms: float
    rate: float


def _workload(rng: random.Random, n: int) -> list[RequestFeatures]:
    """``n`` requests of CONVERSATIONS conversations in progress, each a shared system prompt
    (one of SYSTEM_PROMPTS, SYSTEM_BLOCKS blocks) then TURN_BLOCKS new blocks a turn (the
    user's message and the previous answer); after TURNS turns a conversation ends and a new
    one starts. Conversations take turns in a shuffled cycle, so a turn comes ~0.2 s after
    the previous one (which has finished) and, requests alternating between the routers, at
    either gateway. Chains are 8-32 blocks, ~20 on average; a fifth of each is new."""
    systems = [tuple(rng.getrandbits(63) for _ in range(SYSTEM_BLOCKS))
               for _ in range(SYSTEM_PROMPTS)]
    chains = [systems[rng.randrange(SYSTEM_PROMPTS)] for _ in range(CONVERSATIONS)]
    turns = [rng.randrange(TURNS) for _ in range(CONVERSATIONS)]  # staggered ends
    out: list[RequestFeatures] = []
    order: list[int] = []
    while len(out) < n:
        if not order:
            order = list(range(CONVERSATIONS))
            rng.shuffle(order)
        c = order.pop()
        if turns[c] >= TURNS:
            chains[c], turns[c] = systems[rng.randrange(SYSTEM_PROMPTS)], 0
        chains[c] += tuple(rng.getrandbits(63) for _ in range(TURN_BLOCKS))
        turns[c] += 1
        chain = chains[c]
        out.append(RequestFeatures(model="m", block_hashes=chain,
                                   prompt_tokens=64 * len(chain) + 20, prefix_key=chain[-1]))
    return out


class _PubSub:
    """The rejected alternative: the same batches over PUBLISH/SUBSCRIBE (no catch-up)."""

    def __init__(self, router: Router, url: str, member: str) -> None:
        self.router, self.member = router, member
        self.redis = aioredis.Redis.from_url(url)
        self.sub = aioredis.Redis.from_url(url).pubsub()
        self.lags: list[float] = []
        self.batches = 0

    async def start(self) -> None:
        await self.sub.subscribe("kvgate:routes")
        self.task = asyncio.create_task(self._read())

    async def publish(self, loads: dict[str, ReplicaLoad]) -> None:
        routes = self.router.drain_outbox()
        if routes:
            fields = encode(self.member, time.time(), routes, loads)
            await self.redis.publish("kvgate:routes", orjson_fields(fields))
            self.batches += 1

    async def _read(self) -> None:
        async for msg in self.sub.listen():
            if msg["type"] != "message":
                continue
            batch = decode(fields_of(msg["data"]))
            if batch.member != self.member:
                self.router.apply_peer_routes(batch.routes, batch.member, time.monotonic())
                self.router.apply_peer_load(batch.member, batch.loads, time.monotonic())
                self.lags.append(time.time() - batch.sent_at)

    async def stop(self) -> None:
        self.task.cancel()
        await self.sub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # typed from redis 8.2
        await self.redis.aclose()


def orjson_fields(fields: dict[bytes, bytes]) -> bytes:
    """One message from a batch's fields: 4-byte length-prefixed key/value pairs."""
    parts = []
    for k, v in fields.items():
        parts += [len(k).to_bytes(4, "little"), k, len(v).to_bytes(4, "little"), v]
    return b"".join(parts)


def fields_of(data: bytes) -> dict[bytes, bytes]:
    out, at = {}, 0
    while at < len(data):
        n = int.from_bytes(data[at:at + 4], "little")
        k = data[at + 4:at + 4 + n]
        at += 4 + n
        n = int.from_bytes(data[at:at + 4], "little")
        out[k] = data[at + 4:at + 4 + n]
        at += 4 + n
    return out


class _Own:
    """One router's own requests in flight, as a gateway counts them: each holds its replica
    for HOLD_S, awaiting its first token for the first PREFILL_S. Its views and the loads it
    publishes follow these counts (so the bounded-load rule and the cost model see a real
    load, and conversations keep their replica as they would)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.views = {v.id: v for v in VIEWS}
        self.loads: dict[str, ReplicaLoad] = {}
        self._counts = {r: [0, 0, 0] for r in REPLICAS}  # inflight, prefill, prefill tokens
        self._prefill: deque[tuple[float, str, int]] = deque()
        self._running: deque[tuple[float, str, RequestFeatures]] = deque()

    def _set(self, replica: str) -> None:
        n, p, t = self._counts[replica]
        self.views[replica] = ReplicaView(id=replica, pool="p", inflight=n,
                                          inflight_prefill_tokens=t, inflight_prefill=p)
        work = self.router.own_load(replica) if n else 0.0
        self.loads[replica] = ReplicaLoad(n, p, t, work)

    def route(self, f: RequestFeatures, now: float, held: bool = False) -> str:
        while self._prefill and self._prefill[0][0] <= now:
            _, replica, tokens = self._prefill.popleft()
            c = self._counts[replica]
            c[1] -= 1
            c[2] -= tokens
            self._set(replica)
        while self._running and self._running[0][0] <= now:
            _, replica, done = self._running.popleft()
            self.router.record_answered(replica, done, now)
            self._counts[replica][0] -= 1
            self._set(replica)
        decision = self.router.pick(f, list(self.views.values()), now, held=held)
        replica = decision.replica
        self.router.record_route(replica, f, now)
        c = self._counts[replica]
        c[0] += 1
        c[1] += 1
        c[2] += f.prompt_tokens
        self._prefill.append((now + PREFILL_S, replica, f.prompt_tokens))
        self._running.append((now + HOLD_S, replica, f))
        self._set(replica)
        return replica


async def measure(
    url: str, mode: str, seconds: float, settings: SyncSettings | None = None, step: int = 20,
    rate: float = RATE,
) -> Measured:
    """Route ``rate`` requests/s alternating over two routers, ``step`` requests at a time
    (20 every 10 ms by default; 1: each on its own, as a gateway's arrive); sharing per `mode`.

    Each router's views carry its own load as the gateway's do (`_Own`), so the cost model
    does the same work with sharing off as on and the difference is the sharing's.
    ``route_cpu_us`` is the CPU of the routing loop itself (pick + record_route, peers' load
    and turns included, and the load accounting); the rest of the process's CPU is
    publishing, reading and applying."""
    settings = settings or SyncSettings()
    rng = random.Random(7)
    owns = [_Own(Router(RouterConfig())), _Own(Router(RouterConfig()))]
    syncs: list[RouteSync] = []
    pubs: list[_PubSub] = []
    admin = aioredis.Redis.from_url(url)
    await admin.flushall()
    if mode == "streams":
        for i, own in enumerate(owns):
            syncs.append(RouteSync(own.router, url, "bench", replace(settings, catchup_entries=0),
                                   own_loads=lambda own=own: own.loads,  # type: ignore[misc]
                                   known=lambda r: True, clock=time.monotonic,
                                   member=f"gw{i}"))
        for s in syncs:
            await s.start()
    elif mode == "pubsub":
        for i, own in enumerate(owns):
            own.router.enable_sharing(2.0, f"gw{i}")
            pubs.append(_PubSub(own.router, url, f"gw{i}"))
        for p in pubs:
            await p.start()
    stats = await admin.info("stats")
    before = int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])
    commands = await _commands(admin)
    n = int(rate * seconds)
    features = _workload(rng, n)
    await asyncio.sleep(0.05)  # the readers are waiting
    route_cpu = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    for start in range(0, n, step):  # pace: `step` requests per step / rate seconds
        r0 = time.process_time()
        for i in range(start, min(n, start + step)):
            owns[i % 2].route(features[i], time.monotonic())
        route_cpu += time.process_time() - r0
        if pubs:
            for p, own in zip(pubs, owns, strict=True):
                await p.publish(own.loads)
        await asyncio.sleep(max(0.0, t0 + (start + step) / rate - time.perf_counter()))
    await asyncio.sleep(0.2)  # the last batches are applied
    cpu = time.process_time() - c0
    commands = await _commands(admin) - commands - 2  # (the two INFOs)
    stats = await admin.info("stats")
    after = int(stats["total_net_input_bytes"]), int(stats["total_net_output_bytes"])
    elapsed = time.perf_counter() - t0
    lags = [x for s in syncs for x in s.stats.recent_lags] + [x for p in pubs for x in p.lags]
    batches = sum(s.stats.published for s in syncs) + sum(p.batches for p in pubs)
    for s in syncs:
        await s.stop()
    for p in pubs:
        await p.stop()
    await admin.aclose()
    lags.sort()
    shared = mode != "off"
    return Measured(
        mode=mode, requests=n, cpu_us=cpu / n * 1e6, route_cpu_us=route_cpu / n * 1e6,
        bytes_per_request=(after[0] - before[0]) / n if shared else 0.0,
        bytes_out_per_request=(after[1] - before[1]) / n if shared else 0.0,
        batches_per_s=batches / elapsed, commands_per_s=commands / elapsed,
        lag_p50_ms=statistics.median(lags) * 1e3 if lags else 0.0,
        lag_p99_ms=lags[int(0.99 * (len(lags) - 1))] * 1e3 if lags else 0.0,
        rate=n / elapsed,
    )


async def _commands(admin: aioredis.Redis) -> int:
    """Commands the server has run (its commandstats' calls, summed)."""
    stats = await admin.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


# -- workers ------------------------------------------------------------------------------------
def _tree_cpu(pid: int) -> float:
    """utime+stime of a process and its children (the workers), in seconds."""
    from loadtest.bench_overhead import cpu_seconds

    total = cpu_seconds(pid)
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = f.read().split()
    except OSError:
        kids = []
    return total + sum(_tree_cpu(int(k)) for k in kids)


def workers_run(redis_url: str, workers: int, n: int) -> tuple[float, float, int]:
    """(req/s, gateway CPU µs per request, errors) for one gateway with `workers`."""
    import redis

    from loadtest.bench_overhead import run_level

    # a fresh store: the policy a previous run seeded (its replicas) would win over --upstream
    redis.Redis.from_url(redis_url).flushall()
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "KVGATE_CONFIG": "", "KVGATE_REDIS_URL": redis_url}
    try:
        urls = []
        for _ in range(4):
            port = free_port()
            procs.append(subprocess.Popen(
                [*KVGATE, "sim", "--host", "127.0.0.1", "--port", str(port), "--model",
                 "bench-model", "--time-scale", "50", "--max-num-seqs", "512",
                 "--log-level", "warning"], stdout=subprocess.DEVNULL, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_http(f"{u}/health", 30)
        port = free_port()
        gw = subprocess.Popen(
            [*KVGATE, "serve", "--no-auth", "--host", "127.0.0.1", "--port", str(port),
             "--log-level", "warning", "--workers", str(workers),
             *[a for u in urls for a in ("--upstream", u)]], env=env)
        procs.append(gw)
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/readyz", 30)
        time.sleep(1.0)
        c0 = _tree_cpu(gw.pid)
        level = asyncio.run(run_level([base], False, 64, n))
        cpu = _tree_cpu(gw.pid) - c0
        return n / level.wall_s, cpu / n * 1e6, level.errors
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(15)


# -- simulated time, no Redis: stickiness and the sharing's instructions ------------------------
_OFFLINE_URL = "redis://127.0.0.1:1"  # never dialled: the simulation calls no Redis


@dataclass
class Simulated:
    requests: int
    same_replica: float  # share of conversation turns sent to their previous turn's replica
    cpu_s: float  # process CPU of the whole run (routing, publishing, applying)
    route_cpu_s: float  # of which pick + record_route (as `Measured.route_cpu_us`)


def simulate(flush_s: float | None, requests: int, rate: float = RATE) -> Simulated:
    """The traffic of `measure` in simulated time, two routers sharing through their
    `RouteSync` as under load, Redis taken out: every ``flush_s`` each one's publisher builds
    its batch (outbox, changed loads, the wire format) and the other reads it an interval
    later (`RouteSync._take`: decoding, applying); gateways take turns within two intervals.
    ``flush_s`` None: not sharing. Deterministic, so instruction counts of two trees compare
    (run it under ``valgrind --tool=callgrind`` at two sizes: the difference is per request,
    warm-up and start excluded)."""
    rng = random.Random(7)
    clock = [0.0]
    owns = [_Own(Router(RouterConfig())), _Own(Router(RouterConfig()))]
    syncs: list[RouteSync] = []
    if flush_s is not None:
        settings = SyncSettings(flush_interval_s=flush_s, catchup_entries=0)
        for i, own in enumerate(owns):
            syncs.append(RouteSync(own.router, _OFFLINE_URL, "bench", settings,
                                   own_loads=lambda own=own: own.loads,  # type: ignore[misc]
                                   known=lambda r: True, clock=lambda: clock[0],
                                   member=f"gw{i}"))
    pending: deque[tuple[float, int, list[bytes]]] = deque()
    last: dict[int, str] = {}  # conversation (its first block after the system prompt) -> replica
    same = turns = entry = 0
    published = route_cpu = 0.0
    features = _workload(rng, requests)
    c0 = time.process_time()
    for i, f in enumerate(features):
        now = clock[0] = i / rate
        while pending and pending[0][0] <= now:
            _, g, flat = pending.popleft()
            entry += 1
            syncs[1 - g]._take([(b"bench:routes", [(b"%d-0" % entry, flat)])])
        if syncs and now - published >= flush_s:  # type: ignore[operator]
            published = now
            for g, s in enumerate(syncs):
                fields = s._batch(now)
                if fields is not None:
                    flat = [x for kv in fields.items() for x in kv]
                    pending.append((now + flush_s, g, flat))  # type: ignore[operator]
        r0 = time.process_time()
        replica = owns[i % 2].route(f, now)
        route_cpu += time.process_time() - r0
        conv = f.block_hashes[SYSTEM_BLOCKS]
        if len(f.block_hashes) > SYSTEM_BLOCKS + TURN_BLOCKS:
            turns += 1
            same += last.get(conv) == replica
        last[conv] = replica
    return Simulated(requests, same / turns if turns else 0.0, time.process_time() - c0,
                     route_cpu)


def stickiness(flush_s: float | None, seconds: float = 10.0, rate: float = RATE) -> float:
    """The share of conversation turns after the first that go to the replica of the
    conversation's previous turn (which went through either router), `simulate`d."""
    return simulate(flush_s, int(rate * seconds), rate).same_replica


# -- command line: quick A/B runs -----------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Alternate the modes for a few rounds on one redis-server of its own (drift on a shared
    machine hits every mode alike) and print each round and the medians."""
    import argparse

    from loadtest.fleet import redis_server

    p = argparse.ArgumentParser(prog="python -m loadtest.sync_cost", description=main.__doc__)
    p.add_argument("--seconds", type=float, default=5.0, help="per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="off,streams", help="comma-separated: off, streams, pubsub")
    p.add_argument("--flush-ms", type=float, default=SyncSettings().flush_interval_s * 1000,
                   help="sync.flush_interval_ms (streams)")
    p.add_argument("--hold-picks", action="store_true",
                   help="the routers' callers would hold contested picks (`sync.hold_picks`, "
                        "the live default; the picks here are not held): urgent routes are "
                        "published at once")
    p.add_argument("--step", type=int, default=20,
                   help="requests routed at a time (paced at --rate): 20 every 10 ms; 1 each on "
                        "its own, as a gateway's requests arrive")
    p.add_argument("--rate", type=float, default=RATE, help="routed requests/s, both routers")
    p.add_argument("--stickiness", action="store_true",
                   help="instead: conversation stickiness across the two routers (simulated "
                        "time, no Redis) without sharing and at flush intervals 5-40 ms")
    p.add_argument("--simulate", type=int, metavar="N",
                   help="instead: N requests in simulated time without Redis (`simulate`), "
                        "sharing per --modes (off or streams) at --flush-ms; CPU per request")
    args = p.parse_args(argv)
    if args.simulate is not None:
        for m in args.modes.split(","):
            sim = simulate(None if m == "off" else args.flush_ms / 1000, args.simulate)
            n = max(sim.requests, 1)
            print(f"{m:8} {sim.cpu_s / n * 1e6:6.1f} us/request (routing "
                  f"{sim.route_cpu_s / n * 1e6:5.1f}), same replica {sim.same_replica:.3f}",
                  flush=True)
        return 0
    if args.stickiness:
        for rate, seconds in ((200.0, 60.0), (RATE, 10.0)):
            shares = [f"{'off' if w is None else f'{w * 1000:g} ms'}: "
                      f"{stickiness(w, seconds, rate):.3f}"
                      for w in (None, 0.005, 0.01, 0.02, 0.04)]
            print(f"{rate:.0f} requests/s: " + ", ".join(shares), flush=True)
        return 0
    settings = SyncSettings(flush_interval_s=args.flush_ms / 1000, defer=args.hold_picks)
    modes = args.modes.split(",")
    runs: dict[str, list[Measured]] = {m: [] for m in modes}
    with redis_server() as url:
        for r in range(args.rounds):
            for m in modes:
                got = asyncio.run(measure(url, m, args.seconds, settings, args.step,
                                          args.rate))
                runs[m].append(got)
                print(f"round {r} {_row(got)}", flush=True)
    print("medians:")
    base = statistics.median(x.cpu_us for x in runs["off"]) if "off" in runs else 0.0
    for m, each in runs.items():
        med = Measured(m, each[0].requests, *(statistics.median(getattr(x, k) for x in each)
                                              for k in _NUMBERS))
        extra = f" sharing {med.cpu_us - base:.1f} us/request" if base and m != "off" else ""
        print(f"  {_row(med)}{extra}")
    return 0


_NUMBERS = ("cpu_us", "route_cpu_us", "bytes_per_request", "bytes_out_per_request",
            "batches_per_s", "commands_per_s", "lag_p50_ms", "lag_p99_ms", "rate")


def _row(m: Measured) -> str:
    return (f"{m.mode:8} cpu {m.cpu_us:6.1f} us/req (routing {m.route_cpu_us:5.1f}), "
            f"redis in {m.bytes_per_request:5.0f} B/req out {m.bytes_out_per_request:5.0f} "
            f"B/req, {m.batches_per_s:4.0f} batches/s ({m.commands_per_s:4.0f} commands/s), "
            f"lag p50 {m.lag_p50_ms:6.2f} p99 {m.lag_p99_ms:6.2f} ms, {m.rate:.0f} req/s")


if __name__ == "__main__":
    sys.exit(main())
