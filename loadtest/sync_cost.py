"""Live measurements behind `loadtest.bench_sync`: the CPU and bytes of sharing routing state,
Streams (what kvgate uses) vs pub/sub (the alternative), and gateway workers."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.fleet.records import decode, encode
from gateway.fleet.sync import RouteSync, SyncSettings
from loadtest.fleet import free_port, wait_http
from routing.peers import ReplicaLoad
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

__all__ = ["Measured", "measure", "workers_run"]

RATE = 2000.0  # routed requests per second, over both routers
REPLICAS = [f"10.0.0.{i}:8000" for i in range(8)]
VIEWS = [ReplicaView(id=r, pool="p") for r in REPLICAS]
BLOCKS = 32
KVGATE = [sys.executable, "-m", "gateway.cli"]


@dataclass
class Measured:
    mode: str
    requests: int
    cpu_us: float
    bytes_per_request: float
    batches_per_s: float
    lag_p50_ms: float
    lag_p99_ms: float
    rate: float


def _features(rng: random.Random, conversations: int = 400) -> RequestFeatures:
    conv = rng.randrange(conversations)
    turn = rng.randrange(1, 4)
    chain = tuple(((conv << 20) + i) * 0x9E3779B1 % (1 << 63) for i in range(BLOCKS * turn // 3))
    return RequestFeatures(model="m", block_hashes=chain, prompt_tokens=64 * len(chain) + 20,
                           prefix_key=chain[-1])


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
                self.router.apply_peer_routes(batch.routes, batch.member)
                self.router.apply_peer_load(batch.member, batch.loads, time.monotonic())
                self.lags.append(time.time() - batch.sent_at)

    async def stop(self) -> None:
        self.task.cancel()
        await self.sub.aclose()  # type: ignore[no-untyped-call]
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


async def measure(url: str, mode: str, seconds: float) -> Measured:
    """Route RATE requests/s alternating over two routers; sharing per `mode`."""
    rng = random.Random(7)
    routers = [Router(RouterConfig()), Router(RouterConfig())]
    loads: list[dict[str, ReplicaLoad]] = [{}, {}]
    syncs: list[RouteSync] = []
    pubs: list[_PubSub] = []
    admin = aioredis.Redis.from_url(url)
    await admin.flushall()
    if mode == "streams":
        for i, router in enumerate(routers):
            own = loads[i]
            syncs.append(RouteSync(router, url, "bench", SyncSettings(catchup_entries=0),
                                   own_loads=lambda own=own: own,  # type: ignore[misc]
                                   known=lambda r: True, clock=time.monotonic,
                                   member=f"gw{i}"))
        for s in syncs:
            await s.start()
    elif mode == "pubsub":
        for i, router in enumerate(routers):
            router.enable_sharing(2.0, f"gw{i}")
            pubs.append(_PubSub(router, url, f"gw{i}"))
        for p in pubs:
            await p.start()
    before = int((await admin.info("stats"))["total_net_input_bytes"])
    n = int(RATE * seconds)
    features = [_features(rng) for _ in range(4096)]
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        router = routers[i % 2]
        f = features[i % len(features)]
        now = time.monotonic()
        decision = router.pick(f, VIEWS, now)
        router.record_route(decision.replica, f, now)
        loads[i % 2][decision.replica] = ReplicaLoad(i % 7, i % 3, 512, 256.0)
        if i % 20 == 19:  # pace: 20 requests per 10 ms at 2,000/s
            if pubs:
                for p in pubs:
                    await p.publish(loads[pubs.index(p)])
            await asyncio.sleep(max(0.0, t0 + (i + 1) / RATE - time.perf_counter()))
    await asyncio.sleep(0.2)  # the last batches are applied
    cpu = time.process_time() - c0 - 0.0
    after = int((await admin.info("stats"))["total_net_input_bytes"])
    elapsed = time.perf_counter() - t0
    lags = [x for s in syncs for x in s.stats.recent_lags] + [x for p in pubs for x in p.lags]
    batches = sum(s.stats.published for s in syncs) + sum(p.batches for p in pubs)
    for s in syncs:
        await s.stop()
    for p in pubs:
        await p.stop()
    await admin.aclose()
    lags.sort()
    return Measured(
        mode=mode, requests=n, cpu_us=cpu / n * 1e6,
        bytes_per_request=(after - before) / n if mode != "off" else 0.0,
        batches_per_s=batches / elapsed,
        lag_p50_ms=statistics.median(lags) * 1e3 if lags else 0.0,
        lag_p99_ms=lags[int(0.99 * (len(lags) - 1))] * 1e3 if lags else 0.0,
        rate=n / elapsed,
    )


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
