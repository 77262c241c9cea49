"""A gateway whose reader was cut off from the shared routing state (its event loop stalled,
its link to Redis slow) for longer than the staleness bound, on a real redis-server: the
entries it then reads are as old as they are, whatever else the reply holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import redis

from gateway.fleet.records import encode
from gateway.fleet.settings import SyncSettings
from gateway.fleet.sync import RouteSync
from routing.peers import ReplicaLoad
from routing.router import Router, RouterConfig

KNOWN = {"a:1", "b:1"}
STALE_S = 1.0


async def _until(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _add(client: redis.Redis, member: str, replica: str, inflight: int) -> None:
    """``member``'s batch, written as a peer process writes it: its load on ``replica``."""
    fields = encode(member, time.time(), [], {replica: ReplicaLoad(inflight, 0, 0, 0.0)})
    # redis types fields as an invariant Dict[FieldT, EncodableT]: dict[bytes, bytes] is valid
    client.xadd("kvgate:routes", fields)  # type: ignore[arg-type]


async def test_a_peer_that_died_while_the_reader_was_cut_off_stays_dead(redis_url: str) -> None:
    """A peer wrote its load (3 in flight on a:1) and was killed (no goodbye), another
    wrote a backlog of batches, while this gateway's reader could not read; it reads them
    more than the staleness bound later, a reply at a time. Judged by the newest entry of
    their reply they were current: the dead peer came back as live, its 3 requests busying
    a:1 for another staleness bound. By Redis's clock they are history: no load applied,
    no peer live."""
    router = Router(RouterConfig())
    # (a call timeout longer than the stall: the reader's XREAD is answered, not retried)
    settings = SyncSettings(stale_after_s=STALE_S, catchup_entries=0, timeout_s=5.0,
                            max_entries_per_tick=8)
    me = RouteSync(router, redis_url, "kvgate", settings,
                   own_loads=dict, known=KNOWN.__contains__, clock=time.monotonic,
                   member="me")
    await me.start()
    client = redis.Redis.from_url(redis_url)
    try:
        await _until(lambda: me.stats.published > 0)  # our write taught us Redis's clock
        applied = me.stats.applied
        # the event loop stalls (the reader cannot read) while the peer writes and dies
        _add(client, "dead", "a:1", 3)
        for _ in range(20):
            _add(client, "busy", "b:1", 1)
        time.sleep(STALE_S + 0.5)  # noqa: ASYNC251 (the stall: the loop must not run)
        await _until(lambda: me.stats.applied >= applied + 21)  # the loop runs again: read
        now = time.monotonic()
        assert router.peers is not None
        assert router.peers.members(now) == 0
        assert dict(router.peers.totals(now)) == {}
    finally:
        client.close()
        await me.stop()
