"""A gateway process frozen (SIGSTOP, a VM paused, its event loop blocked) while its shared
routing state's Redis calls were in flight, then resumed: the replies waiting in its sockets
are read, not taken for Redis's failure. Before, every call in flight ran past its timeout
on the loop's clock during the freeze and failed at resume although Redis had answered: the
process reported degraded, backed off, and routed the requests that queued up meanwhile on
a view as old as the freeze while the peers' backlog waited."""

from __future__ import annotations

import asyncio
import time

import redis

from gateway.fleet.records import encode
from gateway.fleet.settings import SyncSettings
from gateway.fleet.sync import RouteSync
from routing.peers import ReplicaLoad
from routing.router import Router, RouterConfig


async def test_a_process_frozen_mid_call_reads_the_reply_at_resume(redis_url: str) -> None:
    router = Router(RouterConfig())
    settings = SyncSettings(stale_after_s=30.0, catchup_entries=0)
    me = RouteSync(router, redis_url, "kvgate", settings, own_loads=dict,
                   known={"a:1"}.__contains__, clock=time.monotonic, member="me")
    writer = redis.Redis.from_url(redis_url)
    await me.start()
    try:
        deadline = time.monotonic() + 5
        while me.degraded or me.stats.published == 0:
            assert time.monotonic() < deadline, "the sharing never came up"
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # the reader waits in its XREAD
        # the process freezes for longer than the link's timeout (1 s + the 0.5 s block);
        # meanwhile a peer writes its load
        time.sleep(0.1)  # noqa: ASYNC251 - the freeze itself
        writer.xadd("kvgate:routes", encode(  # type: ignore[arg-type]
            "peer", time.time(), [], {"a:1": ReplicaLoad(3, 0, 0, 0.0)}, whole=True))
        time.sleep(2.0)  # noqa: ASYNC251
        peers = router.peers
        assert peers is not None
        deadline = time.monotonic() + 0.4  # less than the back-off after a failed call (0.5 s)
        while peers.totals(time.monotonic()).get("a:1") != ReplicaLoad(3, 0, 0, 0.0):
            assert not me.degraded, "a reply read late was taken for Redis down"
            assert time.monotonic() < deadline, "the peer's load was not read at resume"
            await asyncio.sleep(0.01)
        assert not me.degraded
    finally:
        await me.stop()
        writer.close()
