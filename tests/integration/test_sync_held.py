"""`RouteSync` and the held picks' window, against a real redis-server: a busy gateway batches
its routes once per flush interval and reads once per interval, but the route of a pick a
higher-ranked peer may be holding for goes out at once, and a gateway holding a pick reads at
once; while Redis is stopped a hold reads nothing, ends at its bound and the sharing says it
is degraded, then resumes."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from itertools import pairwise
from typing import cast

import redis.asyncio as aioredis

from gateway.fleet.records import decode, encode
from gateway.fleet.settings import SyncSettings
from gateway.fleet.sync import RouteSync
from routing.peers import ReplicaLoad, RouteRecord
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures
from tests.integration.test_sync_apply import _running
from tests.support.procs import redis_proc

KEY = b"kvgate:routes"
IDS = [f"r{i}:1" for i in range(4)]
VIEWS = [ReplicaView(id=r, pool="p") for r in IDS]
FLUSH_S = 1.0  # a batch (and a read) a second: what is faster than that is not batched


def _busy() -> dict[str, ReplicaLoad]:
    """A request in flight: the publisher ticks every interval and reads with its batch."""
    return {IDS[0]: ReplicaLoad(1, 0, 0, 0.0)}


def _sync(url: str, member: str, **settings: float) -> tuple[RouteSync, Router]:
    router = Router(RouterConfig())
    sync = RouteSync(router, url, "kvgate",
                     SyncSettings(flush_interval_s=FLUSH_S, catchup_entries=0, defer=True,
                                  **settings),  # type: ignore[arg-type]
                     own_loads=_busy, known=IDS.__contains__, clock=time.monotonic,
                     member=member)
    return sync, router


def _peer(router: Router) -> None:
    """The other gateway is alive now (a second one: ``a-low`` ranks first, ``z-top`` last)."""
    router.apply_peer_load("z-top" if router.member < "z" else "a-low", {}, time.monotonic())


async def _until(condition: Callable[[], bool], within_s: float) -> float:
    """Seconds until ``condition`` holds (AssertionError past ``within_s``)."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"not within {within_s} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


async def _just_ticked(sync: RouteSync) -> None:
    """Right after a batch: the publisher's next tick is an interval away."""
    n = sync.stats.published
    await _until(lambda: sync.stats.published > n, 3 * FLUSH_S)


async def _routed(r: aioredis.Redis, member: str) -> set[int]:
    """The last blocks of the chains ``member``'s entries in the stream carry."""
    out = set()
    for _, fields in await r.xrange(KEY) or ():
        batch = decode(cast(dict[bytes, bytes], fields or {}))
        if batch.member == member:
            out |= {x.hashes[-1] for x in batch.routes}
    return out


def _cold(start: int) -> RequestFeatures:
    hashes = tuple(range(start, start + 40))
    return RequestFeatures(model="m", block_hashes=hashes, prompt_tokens=64 * 40 + 10,
                           prefix_key=hashes[-1])


async def test_a_contested_route_goes_out_at_once_others_wait_for_the_tick(
    redis_url: str,
) -> None:
    """Rank 0 of 2 (member "a-me" before "z-top"), busy: a route recorded without a pick
    waits for the next tick; a cold pick's (contested: every replica as good) goes out at
    once."""
    sync, router = _sync(redis_url, "a-me")
    async with _running(redis_url, sync) as r:
        await _just_ticked(sync)
        plain = _cold(1_000)
        router.record_route(IDS[1], plain, time.monotonic())
        await asyncio.sleep(0.3)
        assert plain.block_hashes[-1] not in await _routed(r, "a-me")
        await _just_ticked(sync)
        cold = _cold(5_000)
        _peer(router)
        now = time.monotonic()
        router.record_route(router.pick(cold, VIEWS, now).replica, cold, now)
        took = time.monotonic()
        while cold.block_hashes[-1] not in await _routed(r, "a-me"):
            assert time.monotonic() - took < 0.3, "not published at once"
            await asyncio.sleep(0.01)


async def test_urgent_routes_go_out_one_batch_per_gap_not_one_per_pick(
    redis_url: str,
) -> None:
    """Rank 0 of 2, busy, 150 contested picks 2 ms apart (~0.3 s; a 40 ms hold window: a gap
    of 10 ms between urgent batches): the routes go out in at most one batch per gap, each
    batch sent about a gap after the one before, and every route within a gap and a round
    trip of its pick, not at the next tick (a second away). Without the bound each contested
    pick was a batch of its own (~150 here)."""
    sync, router = _sync(redis_url, "a-me", hold_window_s=0.04)
    gap = 0.01  # a quarter of the hold window (`SyncSettings.urgent_gap_s`)
    urgent: list[float] = []
    urge = router.on_urgent
    assert urge is not None

    def counted() -> None:
        urgent.append(time.monotonic())
        urge()

    router.on_urgent = counted
    # when each batch is sent (the publisher's clock): Redis's stamps on arrival are no
    # measure of it on a loaded machine, where a Redis that did not run for a gap took two
    # batches in the same millisecond
    sent: list[float] = []
    publisher_pipeline = sync._out.pipeline

    async def pipeline(*commands: tuple[bytes | str | int, ...]) -> list[object]:
        if any(command[0] == b"XADD" for command in commands):
            sent.append(time.monotonic())
        return await publisher_pipeline(*commands)

    sync._out.pipeline = pipeline  # type: ignore[method-assign]
    async with _running(redis_url, sync) as r:
        await _just_ticked(sync)
        _peer(router)
        before, sent_before = len(await _entry_ms(r)), len(sent)
        t0 = time.monotonic()
        last: list[int] = []
        for i in range(150):  # (so many picks, not so long: a slow machine makes fewer)
            cold = _cold(10_000 + 100 * i)
            now = time.monotonic()
            router.record_route(router.pick(cold, VIEWS, now).replica, cold, now)
            last.append(cold.block_hashes[-1])
            await asyncio.sleep(0.002)
        took = time.monotonic() - t0
        await _until(lambda: not router.outbox, 0.1)  # the last ones are out, not at the tick
        batches = (await _entry_ms(r))[before:]
        sends = sent[sent_before:]
        routed = await _routed(r, "a-me")
    assert len(urgent) >= 50, "the picks were not contested"
    assert set(last) <= routed
    assert len(batches) <= took / gap + 2, (len(batches), len(urgent))
    # (half a gap: room for the batch's own making between the publisher's clock and the send)
    assert min(b - a for a, b in pairwise(sends)) >= gap / 2, sends


async def _entry_ms(r: aioredis.Redis) -> list[int]:
    """The Redis-clock milliseconds of every entry in the stream (from their ids)."""
    entries = cast(list[tuple[bytes, object]], await r.xrange(KEY))
    return [int(entry_id.split(b"-")[0]) for entry_id, _ in entries]


async def test_a_gateway_holding_a_pick_reads_at_once(redis_url: str) -> None:
    """A busy gateway reads with its batches, once an interval; while it holds a pick, a
    peer's entry is applied as soon as it is written."""
    sync, router = _sync(redis_url, "z-me")
    async with _running(redis_url, sync) as r:
        for held, start in ((False, 100), (True, 200)):
            await _just_ticked(sync)
            if held:
                router.holding(time.monotonic() + 0.5)
            chain = tuple(range(start, start + 4))
            await r.xadd(KEY, encode("a-low", time.time(),  # type: ignore[arg-type]
                                     [RouteRecord(IDS[2], chain, 0)], {}))
            wrote = time.monotonic()
            await _until(lambda chain=chain: router.state.index.match_one(  # type: ignore[misc]
                IDS[2], chain) == 4, 3 * FLUSH_S)
            took = time.monotonic() - wrote
            if held:
                assert took < 0.2, took
            else:
                assert took > 0.3, took  # the control: not before the next tick


async def test_a_hold_while_redis_is_stopped_reads_nothing_and_reports_degraded() -> None:
    """Redis stopped (SIGSTOP: connections hang) while a pick is held: the reader's blocked
    read times out, the sharing is degraded, and once Redis answers again the reader applies
    what peers wrote; nothing waits past the hold's end for Redis."""
    proc, url = redis_proc()
    with proc.start():
        sync, router = _sync(url, "z-me", timeout_s=0.3)
        async with _running(url, sync) as r:
            await _just_ticked(sync)
            proc.signal(signal.SIGSTOP)
            try:
                router.holding(time.monotonic() + 0.2)
                await _until(lambda: sync.degraded, 3.0)
            finally:
                proc.signal(signal.SIGCONT)
            await _until(lambda: not sync.degraded, 5.0)
            chain = (7, 8, 9)
            await r.xadd(KEY, encode("a-low", time.time(),  # type: ignore[arg-type]
                                     [RouteRecord(IDS[3], chain, 0)], {}))
            await _until(lambda: router.state.index.match_one(IDS[3], chain) == 3, 3.0)
