"""Shared routing state between two `RouteSync`s on a real redis-server, under what a fleet
meets in production: a replica that leaves one gateway's pools while it had requests there
(drained and reaped between two batches) must not stay busy in the other gateways' views."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from gateway.fleet.sync import RouteSync, SyncSettings
from routing.peers import ReplicaLoad
from routing.router import Router, RouterConfig

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
