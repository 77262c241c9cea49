"""Shared routing state between two `RouteSync`s on a real redis-server, under what a fleet
meets in production: a replica that leaves one gateway's pools while it had requests there
(drained and reaped between two batches) must not stay busy in the other gateways' views."""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
from collections.abc import Callable, Mapping

import pytest
import redis.asyncio as aioredis

from gateway.fleet.link import Link
from gateway.fleet.records import encode
from gateway.fleet.settings import SyncSettings
from gateway.fleet.sync import RouteSync
from routing.peers import ReplicaLoad
from routing.router import Router, RouterConfig
from routing.types import RequestFeatures
from tests.support.procs import Proc, free_port, redis_proc

KNOWN = {"a:1", "b:1"}


def _sync(
    url: str, member: str, own: Callable[[], Mapping[str, ReplicaLoad]], router: Router
) -> RouteSync:
    # a long staleness bound: a peer's load may only go because the peer said so
    settings = SyncSettings(stale_after_s=30.0, catchup_entries=0)
    return RouteSync(router, url, "kvgate", settings, own_loads=own,
                     known=KNOWN.__contains__, clock=time.monotonic, member=member)


async def _until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_replica_gone_from_a_gateway_leaves_its_peers_views(redis_url: str) -> None:
    loads = {"a:1": ReplicaLoad(1, 0, 0, 0.0), "b:1": ReplicaLoad(2, 0, 0, 0.0)}
    router = Router(RouterConfig())
    me = _sync(redis_url, "me", lambda: loads, Router(RouterConfig()))
    peer = _sync(redis_url, "peer", dict, router)
    await peer.start()
    await me.start()
    try:
        peers = router.peers
        assert peers is not None

        def seen() -> Mapping[str, ReplicaLoad]:
            return peers.totals(time.monotonic())

        await _until(lambda: seen().get("a:1") == loads["a:1"] and "b:1" in seen())
        # a:1 was drained and reaped before its last request's end was published: it is no
        # longer among this gateway's replicas at all
        del loads["a:1"]
        me.wake()
        await _until(lambda: "a:1" not in seen(), within_s=2.0)
        assert seen()["b:1"].inflight == 2  # the others are untouched
    finally:
        await me.stop()
        await peer.stop()


async def test_a_fresh_redis_whose_ids_are_behind_the_last_one_read_is_followed() -> None:
    """Redis replaced by a fresh one (state lost) whose stream ids start behind the last id
    a gateway read -- the old server's clock was ahead, e.g. by a minute (here: one entry
    with such an id, which every later id then follows): XREAD after that id returned
    nothing until the new clock caught up, and the gateways, "up", shared nothing."""
    proc, url = redis_proc()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    router, mine = Router(RouterConfig()), Router(RouterConfig())
    me = _sync(url, "me", dict, mine)
    peer = _sync(url, "peer", dict, router)
    with proc:
        await peer.start()
        await me.start()
        r = aioredis.Redis.from_url(url)
        ahead = f"{int(time.time() * 1000) + 60_000}-0"  # written by a clock a minute ahead
        await r.xadd("kvgate:routes", encode("old", time.time(), [], {}),  # type: ignore[arg-type]
                     id=ahead)
        await r.aclose()
        await _until(lambda: peer._last_id == ahead.encode() and me._last_id == ahead.encode())
        # and an entry of each after it (a heartbeat): every id from that clock is ahead
        await _published_again(me, peer)
    fresh, _ = redis_proc(port)
    try:
        with fresh:
            await _published_again(me, peer)  # on the new server (the first may find the
            # old connection closed)
            mine.record_route("a:1", RequestFeatures("m", (11, 12), 200), time.monotonic())
            await _until(lambda: router.state.index.entries("a:1") == 2, within_s=3.0)
    finally:
        await me.stop()
        await peer.stop()


async def _published_again(*syncs: RouteSync) -> None:
    """Each of ``syncs`` has written an entry since now (heartbeats come every 0.5 s)."""
    before = [s.stats.published for s in syncs]
    await _until(lambda: all(s.stats.published > n for s, n in zip(syncs, before, strict=True)),
                 within_s=10.0)


async def test_the_first_batch_after_a_redis_restart_is_published() -> None:
    """Redis restarted: the publisher's connection is closed, and the first batch it sends
    finds out. That batch (here a route, the only one: no heartbeat for a minute) went
    nowhere, counted as unpublished; it is sent again, once, on a new connection."""
    proc, url = redis_proc()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    router, mine = Router(RouterConfig()), Router(RouterConfig())
    quiet = SyncSettings(stale_after_s=30.0, catchup_entries=0, heartbeat_s=60.0)
    me = RouteSync(mine, url, "kvgate", quiet, own_loads=dict, known=KNOWN.__contains__,
                   clock=time.monotonic, member="me")
    peer = _sync(url, "peer", dict, router)
    with proc:
        await peer.start()
        await me.start()
        await _published_again(me)  # the first heartbeat: the publisher's connection is open
    fresh, _ = redis_proc(port)
    try:
        with fresh:
            mine.record_route("a:1", RequestFeatures("m", (11, 12), 200), time.monotonic())
            await _until(lambda: router.state.index.entries("a:1") == 2, within_s=5.0)
            assert me.stats.dropped.get("unpublished", 0) == 0
    finally:
        await me.stop()
        await peer.stop()


async def test_the_apply_lag_does_not_depend_on_the_peers_clocks(redis_url: str) -> None:
    """Peers whose clocks are an hour behind and an hour ahead of ours: the lag was our clock
    minus theirs (an hour, and 0); measured on Redis's clock it is the time the batch waited."""
    me = _sync(redis_url, "me", dict, Router(RouterConfig()))
    await me.start()
    try:
        await _published_again(me)  # our own write told us Redis's clock
        r = aioredis.Redis.from_url(redis_url)
        load = {"a:1": ReplicaLoad(1, 0, 0, 0.0)}
        for member, skew in (("behind", -3600.0), ("ahead", 3600.0)):
            fields = encode(member, time.time() + skew, [], load)
            await r.xadd("kvgate:routes", fields)  # type: ignore[arg-type]
        await r.aclose()
        await _until(lambda: me.stats.lag_count == 2)
        assert all(0.0 <= lag < 600.0 for lag in me.stats.recent_lags), me.stats.recent_lags
    finally:
        await me.stop()


async def test_the_apply_lag_follows_a_fresh_redis_whose_clock_is_behind() -> None:
    """Redis replaced by a fresh one whose clock is behind the old one's (by ten minutes
    here): the offset to Redis's clock was learned from the old server's ids, and the best
    of the last 32 samples kept it (the first write to the new server, on a new connection,
    is no better a sample), so every record applied meanwhile read as ten minutes late."""
    proc, url = redis_proc()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    talkative = SyncSettings(stale_after_s=30.0, catchup_entries=0, heartbeat_s=0.1)
    quiet = SyncSettings(stale_after_s=30.0, catchup_entries=0, heartbeat_s=60.0)
    theirs, mine = Router(RouterConfig()), Router(RouterConfig())
    peer = RouteSync(theirs, url, "kvgate", talkative, own_loads=dict,
                     known=KNOWN.__contains__, clock=time.monotonic, member="peer")
    me = RouteSync(mine, url, "kvgate", quiet, own_loads=dict, known=KNOWN.__contains__,
                   clock=time.monotonic, member="me")

    async def route(n: int) -> None:  # our writes: the only samples of Redis's clock
        before = me.stats.published
        mine.record_route("a:1", RequestFeatures("m", (n, n + 1), 200), time.monotonic())
        me.wake()
        await _until(lambda: me.stats.published > before)

    with proc:
        await peer.start()
        await me.start()
        r = aioredis.Redis.from_url(url)
        ahead = f"{int(time.time() * 1000) + 600_000}-0"  # a clock ten minutes ahead
        await r.xadd("kvgate:routes", encode("old", time.time(), [], {}),  # type: ignore[arg-type]
                     id=ahead)
        await r.aclose()
        for n in range(5):
            await route(10 * n)
    fresh, _ = redis_proc(port)
    try:
        with fresh:
            await route(100)  # finds the new server (its ids behind ours) and reads it
            me.stats.recent_lags.clear()
            await _until(lambda: len(me.stats.recent_lags) >= 3)
            lags = list(me.stats.recent_lags)
            assert max(lags) < 60.0, lags
    finally:
        await me.stop()
        await peer.stop()


async def test_a_new_connection_that_hangs_in_its_handshake_is_a_failure() -> None:
    """Redis gone, and its address taken by a server that accepts connections and never
    answers (one stopped, a proxy holding them while its backend comes up): the call that
    found its connection closed was sent again on a new one, whose handshake (redis-py reads
    the reply to CLIENT SETINFO without a timeout) waited for ever, the sharing "up" and
    publishing nothing. The link's timeout covers the new connection's handshake too."""
    proc, url = redis_proc()
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    link = Link(url, 0.5, 0.5)
    with proc:
        assert await link.call(b"PING") == b"PONG"
    stuck = socket.socket()  # its backlog completes the handshakes; nothing ever reads
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    stuck.bind(("127.0.0.1", port))
    stuck.listen(8)
    call = asyncio.create_task(link.call(b"PING"))
    try:
        await asyncio.wait({call}, timeout=10.0)  # far past the link's timeout
        assert call.done(), "the call still waits"
        with pytest.raises(TimeoutError):
            call.result()
    finally:
        call.cancel()
        stuck.close()
        await link.close()


async def test_the_catch_up_works_where_time_is_refused() -> None:
    """A Redis whose TIME is renamed away (``rename-command TIME ""``, a hardened
    configuration): the catch-up read TIME with the entries, failed as a whole ("cannot reach
    Redis (server replied ERR)" at every start), and the gateway read the whole stream from
    its start instead, history applied as live. Without TIME the peers count as live by the
    stream's newest entry."""
    exe = shutil.which("redis-server")
    assert exe is not None
    port = free_port()
    proc = Proc([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--rename-command", "TIME", ""], ready_port=port)
    url = f"redis://127.0.0.1:{port}/0"
    theirs = Router(RouterConfig())
    with proc:
        peer = _sync(url, "peer", dict, theirs)
        await peer.start()
        try:
            theirs.record_route("a:1", RequestFeatures("m", (11, 12), 200), time.monotonic())
            peer.wake()
            await _published_again(peer)
            mine = Router(RouterConfig())
            me = RouteSync(mine, url, "kvgate", SyncSettings(stale_after_s=30.0), own_loads=dict,
                           known=KNOWN.__contains__, clock=time.monotonic, member="me")
            try:
                assert await me._catch_up() == 1
                assert mine.state.index.entries("a:1") == 2  # the peer's route, before serving
            finally:
                await me.stop()
        finally:
            await peer.stop()
