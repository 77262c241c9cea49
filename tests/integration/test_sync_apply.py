"""`RouteSync` against a real redis-server: catch-up at start, bounded work per event-loop
turn on a backlog, foreign / malformed / unknown-version / own records, goodbye, the start
lines."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from gateway.fleet.records import encode
from gateway.fleet.settings import SyncSettings
from gateway.fleet.sync import RouteSync
from routing.peers import ReplicaLoad, RouteRecord
from routing.router import Router, RouterConfig
from routing.types import RequestFeatures
from tests.support.procs import free_port

KEY = b"kvgate:routes"
KNOWN = {"a:1", "b:1"}


def _busy() -> dict[str, ReplicaLoad]:
    """A gateway's own load with a request in flight (peers hold some of its load)."""
    return {"a:1": ReplicaLoad(1, 0, 0, 0.0)}


def _sync(
    url: str, router: Router, own_loads: Callable[[], Mapping[str, ReplicaLoad]] = dict,
    **settings: float,
) -> RouteSync:
    return RouteSync(router, url, "kvgate", SyncSettings(**settings),  # type: ignore[arg-type]
                     own_loads=own_loads, known=KNOWN.__contains__, clock=time.monotonic,
                     member="me")


@asynccontextmanager
async def _running(url: str, sync: RouteSync) -> AsyncIterator[aioredis.Redis]:
    """``sync`` started, and a client of its Redis; both stopped at the end."""
    r = aioredis.Redis.from_url(url)
    await sync.start()
    try:
        yield r
    finally:
        await sync.stop()
        await r.aclose()


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):  # 5 s
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


async def _add(r: aioredis.Redis, fields: dict[bytes, bytes]) -> None:
    # redis types fields as an invariant Dict[FieldT, EncodableT]: dict[bytes, bytes] is valid
    await r.xadd(KEY, fields)  # type: ignore[arg-type]


async def _written(r: aioredis.Redis) -> list[dict[bytes, bytes]]:
    """The fields of every entry in the stream."""
    return [cast(dict[bytes, bytes], f) for _, f in await r.xrange(KEY) or () if f]


async def test_backlog_is_applied_in_bounded_steps(redis_url: str) -> None:
    router = Router(RouterConfig())
    sync = _sync(redis_url, router, max_entries_per_tick=8, catchup_entries=0)
    async with _running(redis_url, sync) as r:
        await asyncio.sleep(0.2)  # the reader waits for new entries
        # the backlog lands at once (one pipeline): added one await at a time, a reader with
        # CPU to spare applied each as it came, and no backlog was left to measure
        pipe = r.pipeline(transaction=False)
        for i in range(200):
            pipe.xadd(KEY, encode("peer", time.time(),  # type: ignore[arg-type]
                                  [RouteRecord("a:1", (i + 1, i + 2), 0)],
                                  {"a:1": ReplicaLoad(1, 0, 0, 0.0)}))
        await pipe.execute()
        samples = [sync.stats.applied]
        assert samples[0] < 200, "the backlog was applied before it could be measured"
        while sync.stats.applied < 200:
            await asyncio.sleep(0)  # one event-loop turn
            samples.append(sync.stats.applied)
        steps = [b - a for a, b in itertools.pairwise(samples)]
        assert max(steps) <= 8  # never more than one read's worth per turn
        assert router.state.index.entries("a:1") == 201


async def test_bad_foreign_own_and_future_records(redis_url: str) -> None:
    router = Router(RouterConfig())
    sync = _sync(redis_url, router, catchup_entries=0)
    async with _running(redis_url, sync) as r:
        await asyncio.sleep(0.2)
        await _add(r, {b"v": b"1", b"m": b"peer", b"t": b"1.0", b"h": b"\x00" * 3,
                       b"r": b"[[\"a:1\",0,1]]"})
        await _add(r, {**encode("peer", time.time(), [], {}), b"v": b"9"})
        await _add(r, encode("peer", time.time(), [RouteRecord("z:9", (5,), 0)], {}))
        await _add(r, encode("me", time.time(), [RouteRecord("a:1", (6,), 0)], {}))
        await _add(r, encode("peer", time.time(), [], {"b:1": ReplicaLoad(3, 0, 0, 0.0)}))
        await _until(lambda: sync.stats.applied >= 2)
        assert sync.stats.dropped == {"malformed": 1, "version": 1, "foreign": 1}
        assert router.state.index.entries("a:1") == 0  # its own record is not applied again
        assert router.peers is not None
        assert router.peers.totals(time.monotonic())["b:1"].inflight == 3
        await _add(r, encode("peer", time.time(), [], {}, bye=True))
        peers = router.peers
        await _until(lambda: not peers.members(time.monotonic()))
        assert router.peers.totals(time.monotonic()) == {}  # a goodbye drops its load now


async def test_a_new_gateway_catches_up_on_routes_not_on_old_loads(redis_url: str) -> None:
    r = aioredis.Redis.from_url(redis_url)
    for i in range(50):
        await _add(r, encode("old-peer", time.time(), [RouteRecord("a:1", (i + 1,), 0)],
                             {"a:1": ReplicaLoad(9, 0, 0, 0.0)}))
    await r.aclose()
    router = Router(RouterConfig())
    sync = _sync(redis_url, router, catchup_entries=20)
    async with _running(redis_url, sync):
        assert router.state.index.entries("a:1") == 20  # warm from the last 20 entries
        assert router.peers is not None and router.peers.totals(time.monotonic()) == {}
        assert not sync.degraded



async def test_caught_up_routes_make_no_context_live(redis_url: str) -> None:
    """The catch-up's routes are history (minutes old, applied in one go): they warm the
    index, but none of their agents' calls counts as a quick return, so no context is live
    on a replica because of them."""
    r = aioredis.Redis.from_url(redis_url)
    for agent in range(20):  # three calls each, each one extending the last
        base = 10 * (agent + 1)
        for call in range(3):
            chain = tuple(range(base, base + 2 + call))
            await _add(r, encode("old-peer", time.time(), [RouteRecord("a:1", chain, 0)], {}))
    await r.aclose()
    router = Router(RouterConfig())
    sync = _sync(redis_url, router)
    async with _running(redis_url, sync):
        assert router.state.index.entries("a:1") > 0
        sessions = cast(Any, router.policy)._sessions
        assert dict(sessions.live(time.monotonic())) == {}


async def test_the_start_lines_say_where_it_connects_and_how_many_peers_are_live(
    redis_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Peers live at start: those that wrote within ``stale_after_s`` and did not say goodbye,
    judged by when Redis wrote their entries, not by their clocks (here "old", 10 s ago by
    Redis's clock, has a clock an hour ahead; "live-2" and "live-3" clocks an hour behind:
    counted by their clocks, that made 2 live peers, "old" and "live-1")."""
    caplog.set_level(logging.INFO, logger="gateway.fleet")
    r = aioredis.Redis.from_url(redis_url)
    now = time.time()
    seconds, micros = await r.time()
    redis_ms = seconds * 1000 + micros // 1000
    fields = encode("old", now + 3600, [], {})
    await r.xadd(KEY, fields, id=f"{redis_ms - 10_000}-0")  # type: ignore[arg-type]
    for member, sent_at, bye in [("left", now, False), ("left", now, True),
                                 ("live-1", now, False), ("live-2", now - 3600, False),
                                 ("live-3", now - 3600, False)]:
        await _add(r, encode(member, sent_at, [], {}, bye=bye))
    await r.aclose()
    sync = _sync(redis_url, Router(RouterConfig()), stale_after_s=2.0)
    async with _running(redis_url, sync):
        address = redis_url.removeprefix("redis://").removesuffix("/0")
        assert [m.getMessage() for m in caplog.records] == [
            f"shared routing state: connecting to Redis at {address}",
            "shared routing state on (3 peers)",
        ]


@pytest.mark.parametrize("catchup_entries", [0, 20])
async def test_an_unreachable_redis_is_named_at_start_and_never_said_on(
    catchup_entries: int, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.fleet")
    port = free_port()  # nothing listens there
    url = f"redis://:sync-secret-pw@127.0.0.1:{port}/0"
    sync = _sync(url, Router(RouterConfig()), catchup_entries=catchup_entries)
    await sync.start()
    try:
        assert sync.degraded
        assert [m.getMessage() for m in caplog.records] == [
            f"shared routing state: connecting to Redis at 127.0.0.1:{port}",
            f"shared routing state: cannot reach Redis at 127.0.0.1:{port} (connection "
            "refused); retrying every 0.5 s",
        ]
    finally:
        await sync.stop()


async def test_publishes_routes_and_load_changes(redis_url: str) -> None:
    router = Router(RouterConfig())
    loads = {"a:1": ReplicaLoad(1, 1, 64, 64.0)}
    sync = _sync(redis_url, router, lambda: loads, catchup_entries=0)
    async with _running(redis_url, sync) as r:
        from routing.types import RequestFeatures

        router.record_route("a:1", RequestFeatures("m", (11, 12), 200), time.monotonic())
        await _until(lambda: sync.stats.published >= 1)
        for _ in range(500):  # the route's batch (a first heartbeat may come before it)
            routed = [f for f in await _written(r) if b"r" in f]
            if routed:
                break
            await asyncio.sleep(0.01)
        fields = routed[0]
        assert fields[b"m"] == b"me" and b"a:1" in fields[b"r"]
        assert any(b"a:1" in f.get(b"l", b"") for f in await _written(r))
    r = aioredis.Redis.from_url(redis_url)
    entries = await r.xrange(KEY)
    await r.aclose()
    assert entries
    last = entries[-1][1]
    assert last is not None and b"b" in last  # a clean stop says goodbye


async def test_a_busy_gateway_reads_with_its_batches_once_per_interval(redis_url: str) -> None:
    """With requests in flight here the publisher ticks every flush interval and reads the
    new entries in the same round trip as its batch (XADD + XREAD pipelined); the reader
    stands by. A peer writing every 2 ms costs one round trip per interval, not one per
    entry, and every entry is applied exactly once."""
    router = Router(RouterConfig())
    interval = 0.02
    sync = _sync(redis_url, router, _busy, flush_interval_s=interval, catchup_entries=0)
    calls = {"read": 0, "round": 0}
    reader_call, publisher_pipeline = sync._in.call, sync._out.pipeline

    async def read(*args: bytes | str | int) -> object:
        calls["read"] += 1
        return await reader_call(*args)

    async def pipeline(*commands: tuple[bytes | str | int, ...]) -> list[object]:
        calls["round"] += 1
        return await publisher_pipeline(*commands)

    sync._in.call = read  # type: ignore[method-assign]
    sync._out.pipeline = pipeline  # type: ignore[method-assign]
    async with _running(redis_url, sync) as r:
        await _until(lambda: sync._load.published != {})  # our load is out: the publisher reads
        await asyncio.sleep(2 * interval)
        before = dict(calls)
        t0 = time.monotonic()
        for i in range(100):
            await _add(r, encode("peer", time.time(), [RouteRecord("a:1", (i + 1, i + 2), 0)],
                                 {"b:1": ReplicaLoad(i % 5 + 1, 0, 0, 0.0)}))
            await asyncio.sleep(0.002)
        await _until(lambda: sync.stats.applied >= 100)
        elapsed = time.monotonic() - t0
        rounds = calls["round"] - before["round"]
        assert rounds <= elapsed / interval + 3, (rounds, elapsed)
        assert calls["read"] - before["read"] <= 1  # at most the read pending when busy began
        await asyncio.sleep(3 * interval)
        assert sync.stats.applied == 100  # none twice
        assert router.state.index.entries("a:1") == 101
        assert router.peers is not None
        assert router.peers.totals(time.monotonic())["b:1"].inflight == 5  # the latest


async def test_an_idle_gateway_publishes_once_then_waits(redis_url: str) -> None:
    """A route with nothing in flight is published at once; then the publisher waits for the
    next wake or heartbeat instead of ticking every flush interval with nothing to send."""
    router = Router(RouterConfig())
    sync = _sync(redis_url, router, flush_interval_s=0.02, heartbeat_s=30, catchup_entries=0)
    batches = 0
    batch = sync._batch

    def counted(now: float) -> dict[bytes, bytes] | None:
        nonlocal batches
        batches += 1
        return batch(now)

    sync._batch = counted  # type: ignore[method-assign]
    async with _running(redis_url, sync):
        from routing.types import RequestFeatures

        router.record_route("a:1", RequestFeatures("m", (21, 22), 200), time.monotonic())
        sync._wake.set()
        await _until(lambda: sync.stats.published >= 1)
        settled = batches
        await asyncio.sleep(0.5)  # 25 flush intervals
        assert batches - settled <= 1, batches - settled


async def test_own_entries_are_skipped_unread(redis_url: str) -> None:
    """Entries this process wrote come back on the one stream: skipped before decoding
    (neither applied nor counted as malformed, even when they would not decode)."""
    router = Router(RouterConfig())
    sync = _sync(redis_url, router, catchup_entries=0)
    async with _running(redis_url, sync) as r:
        await asyncio.sleep(0.1)
        await _add(r, {b"v": b"1", b"m": b"me", b"t": b"1.0", b"h": b"\x00" * 3})
        await _add(r, encode("peer", time.time(), [RouteRecord("a:1", (1,), 0)], {}))
        await _until(lambda: sync.stats.applied >= 1)
        assert sync.stats.dropped == {}
        assert router.state.index.entries("a:1") == 1


async def test_stop_ends_the_loops_even_if_a_cancellation_is_swallowed(redis_url: str) -> None:
    """A shutdown never hangs: a loop whose cancellation a library swallowed (redis-py's
    write through `asyncio.wait_for` did, on Python 3.11) is cancelled again."""
    router = Router(RouterConfig())
    sync = _sync(redis_url, router, _busy, catchup_entries=0)
    publisher_pipeline = sync._out.pipeline
    swallowed: list[bool] = []

    async def pipeline(*commands: tuple[bytes | str | int, ...]) -> list[object]:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            if not swallowed:
                swallowed.append(True)
                return [None] * len(commands)  # as if the round trip had completed
            raise
        return await publisher_pipeline(*commands)

    sync._out.pipeline = pipeline  # type: ignore[method-assign]
    await sync.start()
    await _until(lambda: sync._load.published != {})
    loops = list(sync._tasks)
    t0 = time.monotonic()
    await asyncio.wait_for(sync.stop(), 5.0)
    assert swallowed and all(t.done() for t in loops) and time.monotonic() - t0 < 4.0


async def test_a_redis_that_refuses_writes_is_down_until_writes_succeed(
    redis_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis out of memory under ``noeviction`` (or a replica after a failover: READONLY)
    answers reads and refuses writes. The sharing is down -- its records go nowhere -- and
    says so once, with the server's reason; it must not flip to "answers again" whenever a
    read goes through (a warning and an info line every half second, /readyz flapping), and
    it recovers once writes succeed again."""
    caplog.set_level(logging.INFO, logger="gateway.fleet")
    sync = _sync(redis_url, Router(RouterConfig()), _busy, catchup_entries=0)
    async with _running(redis_url, sync) as r:
        await _until(lambda: sync.stats.published >= 1)
        caplog.clear()
        await r.config_set("maxmemory", 1)  # every write is OOM under noeviction
        try:
            await _until(lambda: sync.degraded)
            seen = set()
            for _ in range(150):  # 1.5 s: three retries of the publisher, reads meanwhile
                seen.add(sync.degraded)
                await asyncio.sleep(0.01)
            assert seen == {True}
        finally:
            await r.config_set("maxmemory", 0)
        await _until(lambda: not sync.degraded)
        published = sync.stats.published
        await _until(lambda: sync.stats.published > published)  # writes again
    lines = [m.getMessage() for m in caplog.records]
    assert lines == [
        f"shared routing state: refused by Redis at {sync.reach.address} (server replied "
        "OOM); retrying every 0.5 s",
        lines[1],
    ], lines
    assert lines[1].startswith(
        f"shared routing state: Redis at {sync.reach.address} answers again")


async def test_the_stream_stays_within_its_memory_budget(redis_url: str) -> None:
    """Large batches (a high request rate) fill the stream long before `stream_maxlen`
    entries: trimmed by entries alone, 600 batches of ~3.4 KB kept them all (~2.4 MiB
    here, ~270 MB at 2,000 requests/s with the defaults); the budget keeps it under 1 MiB."""
    router = Router(RouterConfig())
    sync = _sync(redis_url, router, flush_interval_s=0.002, catchup_entries=0,
                 stream_max_mb=1)
    async with _running(redis_url, sync) as r:
        blocks = itertools.count(1)
        for _ in range(600):
            published = sync.stats.published
            for _ in range(2):  # 2 routes of 200 blocks a batch
                chain = tuple(next(blocks) for _ in range(200))
                router.record_route("a:1", RequestFeatures("m", chain, 200 * 64),
                                    time.monotonic())
            await _until(lambda n=published: sync.stats.published > n)  # type: ignore[misc]
        used = await r.memory_usage(KEY, samples=0)
        length = await r.xlen(KEY)
    assert used is not None and used <= 1 << 20, (used, length)
    assert 100 <= length < 600
