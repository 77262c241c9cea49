"""Which replicas exist: policy versions and discovery sources re-list pools.

Newcomers are scraped and watched by shared state; leavers drain (no new picks, their
in-flight requests finish, still scraped: a stalled engine is seen), then the scraper and the
router forget them. Two things of a
leaver stay `linger_s` longer (`upstream.total_timeout_s`: by then every exchange that could
still reach them has ended, a stored response's GET included, and Prometheus has scraped their
last counts): a drained replica's `kvgate_requests_total` series, and a pool a policy version
removed (its transport, its replicas' last state, its pool-level series and the counts
`kvgate doctor` reads). Then they go: a fleet whose replicas come and go -- a new pod address
at every rollout -- kept a series set for every address it ever served from, and a client
and a series set for every pool ever removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable

from gateway.discovery import DiscoveryConfigError, DiscoveryManager, build_discovery
from gateway.errors import ConfigError
from gateway.fleet.sync import RouteSync
from gateway.metrics import GatewayMetrics
from gateway.pool import Pool, PoolChanges, Pools
from gateway.replicas import Replica
from gateway.scrape import Scraper
from gateway.tenancy import PolicySnapshot
from routing.router import Router

__all__ = ["REAP_INTERVAL_S", "Membership"]

log = logging.getLogger(__name__)
DISCOVERY_FIRST_SYNC_S = 5.0  # start-up waits this long for discovered replicas, at most
REAP_INTERVAL_S = 0.25  # how often draining replicas are checked for their last request


class Membership:
    """Follows the replica lists: policy versions and discovery re-list pools."""

    def __init__(
        self, pools: Pools, by_id: dict[str, Replica], router: Router, scraper: Scraper,
        sync: RouteSync | None, metrics: GatewayMetrics, clock: Callable[[], float],
        linger_s: float,
    ) -> None:
        self._pools = pools
        self._by_id = by_id
        self._router = router
        self._scraper = scraper
        self._sync = sync
        self._metrics = metrics
        self._clock = clock
        self._linger_s = linger_s
        self.discovery = DiscoveryManager(build_discovery, self.discovered)
        self._background: set[asyncio.Task[None]] = set()  # one-off (discovery re-sync)
        self._first_syncs: set[asyncio.Task[None]] = set()  # waits for one (`_drop_unsynced`)
        # (when to forget it, what): drained replicas' series, removed pools; oldest first
        self._drained: deque[tuple[float, Replica]] = deque()
        self._retired: deque[tuple[float, Pool]] = deque()
        self._closed = False

    async def start_discovery(self) -> None:
        """Sources for the pools that have `discovery`; wait (bounded) for their first sets."""
        self.discovery.expect(self._pools.doc.pools)
        try:
            await self.discovery.sync(self._pools.doc.pools, strict=True)
        except DiscoveryConfigError as exc:
            raise ConfigError(str(exc)) from None
        if self.discovery.pools:
            late = await self.discovery.wait_synced(DISCOVERY_FIRST_SYNC_S)
            if late:
                log.warning("discovery not synced yet; those pools start empty",
                            extra={"pools": late})
                self._unlisted(late)

    def policy_changed(self, snap: PolicySnapshot) -> None:
        """A new policy version: follow its pools (the scraper, router, discovery follow too)."""
        if self._closed:
            return
        before = self._pools.doc.pools
        changes = self._pools.apply(snap.doc)
        self.discovery.expect(snap.doc.pools)  # (its sources are re-synced in a task)
        self._follow(changes)
        due = self._clock() + self._linger_s
        self._retired.extend((due, pool) for pool in changes.retired)
        # pools whose replicas were listed, now discovered (another mapping keeps the last
        # set its source found until the new one publishes: an API outage empties no pool)
        switched = [name for name, pc in snap.doc.pools.items() if pc.discovery
                    and (name not in before or not before[name].discovery)]
        task = asyncio.create_task(self._follow_discovery(snap, switched))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        log.info("policy applied", extra={"version": snap.version, "added": len(changes.added),
                                          "removed": len(changes.removed)})

    async def _follow_discovery(self, snap: PolicySnapshot, switched: list[str]) -> None:
        """Discovery follows a policy version; a pool it `switched` from listed replicas to
        discovery keeps them while its source has the start-up's time for a first sync, not
        longer (`_drop_unsynced`)."""
        await self.discovery.sync(snap.doc.pools)
        listed = [name for name in switched if self.discovery.pending(name)
                  and (pool := self._pools.by_name.get(name)) is not None and pool.replicas]
        if listed and not self._closed:
            task = asyncio.create_task(self._drop_unsynced(listed, snap))
            self._first_syncs.add(task)
            task.add_done_callback(self._first_syncs.discard)

    async def _drop_unsynced(self, listed: list[str], snap: PolicySnapshot) -> None:
        """A pool's replicas come from discovery only: kept until it published, a discovery
        that never syncs (an unreachable API server, a wrong Service) left the pool served by
        replicas its policy no longer names, ready, with nothing saying so."""
        late = await self.discovery.wait_synced(DISCOVERY_FIRST_SYNC_S)
        # (not overtaken: a later version that gives the pool the same mapping, one that
        # changed another pool or a tier, drops them as well -- it is no switch itself)
        now = self._pools.doc.pools
        late = [name for name in late if name in listed and self.discovery.pending(name)
                and name in now and now[name].discovery == snap.doc.pools[name].discovery]
        if late and not self._closed:
            log.warning("discovery not synced yet; the pools' listed replicas are dropped",
                        extra={"pools": late})
            self._unlisted(late)

    def _unlisted(self, pools: list[str]) -> None:
        """Pools whose discovery has not synced yet have no replica until it does (listed
        ones drain)."""
        for name in pools:
            self.discovered(name, frozenset())

    def discovered(self, pool: str, urls: frozenset[str]) -> None:
        """Discovery's `on_change` (sync, on the loop): re-list the pool; leavers drain."""
        if self._closed:
            return
        changes = self._pools.set_discovered(pool, urls)
        self._follow(changes)
        if changes:
            log.info("pool replicas changed", extra={
                "pool": pool, "replicas": len(urls),
                "added": [r.id for r in changes.added],
                "draining": [r.id for r in changes.removed]})

    def _follow(self, changes: PoolChanges) -> None:
        """Scrape the new replicas. One that started draining is scraped until it is reaped:
        its requests still there are judged by its engine's counters (`gateway.stall`), so
        a hung engine discovery removed has them cut and tried elsewhere (unscraped, they
        waited for their timeouts)."""
        for replica in changes.added:
            if self._by_id.get(replica.id) is replica:  # back while draining: scraped still
                continue
            self._by_id[replica.id] = replica
            if self._sync is not None:
                replica.watch = self._sync.wake
            self._scraper.add_target(replica.id, replica.url)

    def _forget_scraped(self, replica: Replica) -> None:
        """A reaped replica is scraped no more (unless it is back, as another replica)."""
        if self._by_id.get(replica.id) is replica:
            del self._by_id[replica.id]
            self._scraper.remove_target(replica.id)

    async def reap_drained(self) -> None:
        """Forget drained replicas once their last in-flight request has finished, and what
        lingers of them and of removed pools once its time has come."""
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            await self.reap_once()

    async def reap_once(self) -> None:
        pools, now = self._pools, self._clock()
        for replica in pools.reap():
            self._forget_scraped(replica)
            if not any(r.id == replica.id for r in pools.replicas()):
                self._router.forget_replica(replica.id)
            self._drained.append((now + self._linger_s, replica))
            log.info("replica drained", extra={"pool": replica.pool, "replica": replica.id})
        while self._drained and self._drained[0][0] <= now:
            gone = self._drained.popleft()[1]
            # back in its pool (or draining again, to be forgotten later): its series go on
            if not any(r.pool == gone.pool and r.id == gone.id for r in pools.described()):
                self._metrics.forget_replica(gone.pool, gone.id)
        while self._retired and self._retired[0][0] <= now:
            pool = self._retired.popleft()[1]
            if any(pool.by_id.get(r.id) is r for r in pools.draining):  # not over yet
                self._retired.append((now + self._linger_s, pool))
                continue
            await pools.close_retired(pool)
            if pool.name not in pools.by_name and all(p.name != pool.name for p in pools.retired):
                self._metrics.forget_pool(pool.name)  # (not back, nor removed again since)

    def close(self) -> None:
        """Stop following: later policy versions and discovery changes are ignored."""
        self._closed = True

    async def stop(self) -> None:
        self._closed = True
        for task in list(self._background):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task in list(self._first_syncs):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.discovery.stop()
