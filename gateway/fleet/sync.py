"""Shared routing state over Redis: every gateway process publishes what it routed and its own
per-replica load, and applies every other process's records to its router.

One Redis Stream per namespace (``{namespace}:routes``), trimmed to about ``stream_maxlen``
entries, fewer when they are large (``stream_max_mb``: `gateway.fleet.budget`). Two owned
tasks, one raw connection each:

- the publisher takes the router's outbox (chains it routed) and the own loads that changed
  since the last batch (all non-zero ones, and an empty batch as a sign of life, every
  ``heartbeat_s``) and appends one entry (XADD, approximate trim): at once when a route is
  queued or a request ends after a quiet ``flush_interval_ms``, or when the route is one a
  higher-ranked peer may be holding a pick for (`Router.on_urgent`; at most one such batch
  per `SyncSettings.urgent_gap_s`, the others joining it), else once per interval.
  While some of its load is out there (requests in flight) it ticks every interval and reads
  the new entries in the same round trip (XREAD pipelined after the XADD);
- the reader blocks on XREAD while the publisher does not read (nothing in flight here: the
  first entry after a quiet spell is applied at once), at most once per interval; and while
  a pick is held here (`Router.holding`) it reads at once, so the lower ranks' picks of the
  same instant are applied a round trip after they are written: the held picks wait a hold
  window (``hold_window_ms``), not the batches' sync window.

Either way a read returns at most ``max_entries_per_tick`` entries, which are applied before
the loop yields to the event loop, so a burst after an outage never stalls request handling;
the entries this process wrote come back too (one stream) and are skipped undecoded. Under
load a gateway makes one Redis round trip per interval, whatever the request rate and the
number of peers: the client's CPU per request falls as batches grow.

Nothing here is on the request path: a request reads the router's memory only. While Redis is
down or slow, publishing and reading fail fast, the gateway routes on its own state (peers age
out after ``stale_after_s``), reports ``degraded``, and resumes on its own: the reader
continues after the last entry it saw (what was trimmed meanwhile is lost, harmlessly), the
publisher re-sends its whole load, zeros included (`_down`). At start the reader first
applies the routes of the last ``catchup_entries`` entries, so a new or restarted gateway
begins warm, not cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Mapping

from redis.exceptions import RedisError, ResponseError

from gateway.fleet.budget import StreamBudget
from gateway.fleet.dropped import DroppedEntries
from gateway.fleet.farewell import member_note
from gateway.fleet.link import Link
from gateway.fleet.peer_replicas import PeerReplicas
from gateway.fleet.published import PublishedLoad
from gateway.fleet.records import BadRecord, Batch, UnknownVersion, decode, encode
from gateway.fleet.redis_clock import RedisClock
from gateway.fleet.replies import entries, entry_key, entry_ms, time_ms
from gateway.fleet.settings import SyncSettings
from gateway.fleet.stats import SyncStats
from gateway.tenancy.key_types import WRONG_TYPE
from gateway.tenancy.reachability import Reachability
from gateway.tenancy.redis_conn import cause_label, failure_cause
from gateway.worker_metrics import current as current_slot
from routing.peers import ReplicaLoad
from routing.router import Router

__all__ = ["RouteSync", "member_id"]

log = logging.getLogger(__name__)

RETRY_S = 0.5  # back-off after a failed Redis call
_BLOCK_S = 0.5  # the reader's XREAD BLOCK
_BLOCK_MS = int(_BLOCK_S * 1000)


def member_id() -> str:
    """This process's id among the gateways: host, pid and a random part (pids repeat)."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{os.urandom(3).hex()}"


class RouteSync:
    """Publishes this gateway's records and applies its peers' (owned by the app's lifespan).

    ``own_loads()`` returns this gateway's load per replica it knows; ``known(replica)`` says
    whether a replica id belongs to one of its pools (routes to others are dropped as
    ``foreign``: another gateway with another config). ``clock`` is the router's clock.
    """

    def __init__(
        self, router: Router, redis_url: str, namespace: str, settings: SyncSettings,
        own_loads: Callable[[], Mapping[str, ReplicaLoad]], known: Callable[[str], bool],
        clock: Callable[[], float], member: str | None = None,
    ) -> None:
        self.member = member or member_id()
        self._member = self.member.encode()
        self.key = f"{namespace}:routes".encode()
        self.settings = settings
        self.stats = SyncStats()
        self._router = router
        self._own_loads = own_loads
        self._known = known
        self._clock = clock
        self._load = PublishedLoad(settings.heartbeat_s)  # what peers believe of our load
        self._last_id = b"0-0"  # the newest entry applied (or skipped: our own, bad)
        self._last_key = (0, 0)  # the same as numbers, to compare
        self._last_own = (0, 0)  # the id of our newest entry, as numbers (`_check_order`)
        self._stale_ms = int(settings.stale_after_s * 1000)
        self._tasks: list[asyncio.Task[None]] = []
        timeout = settings.timeout_s
        self._out = Link(redis_url, timeout, timeout)  # the publisher's
        self._in = Link(redis_url, timeout, timeout + _BLOCK_S)  # the reader's (blocking)
        # what the log says about reaching Redis: both loops report their failures to it
        self.reach = Reachability(self._in.address, retry_every_s=RETRY_S,
                                  subject="shared routing state", logger=log, tls=self._in.tls)
        # peers' records arrive about a flush interval or two late (`window_s`): within it the
        # gateways hold their contested picks until the lower ranks' have arrived
        # (routing.router.Router.defer_s), or take turns over equally good replicas
        # (`routing.turns.Turns.turn`)
        router.enable_sharing(settings.stale_after_s, self.member, settings.window_s,
                              settings.defer, settings.hold_s)
        self._wake = asyncio.Event()
        router.on_outbox = self._wake.set
        # a route a peer may hold a pick for is queued: publish it now, not at the next tick
        self._urged = asyncio.Event()
        router.on_urgent = self._urge
        self._calm = asyncio.Event()  # set while the publisher does not read (the reader does)
        self._calm.set()
        # the reader's wake-up: the publisher stopped reading, or a pick is held here (the
        # reader then reads at once, blocking until the next entry or the hold's end)
        self._go = asyncio.Event()
        router.on_hold = self._go.set
        # the publisher's last call failed: a read that goes through does not make the sharing
        # up (a Redis out of memory, or a replica after a failover, answers reads and refuses
        # writes: "up" on every read was a warning and an info line every half second)
        self._write_failed = False
        self._redis_clock = RedisClock()  # the apply lag's clock, learned from our writes
        self._budget = StreamBudget(settings.stream_maxlen, settings.stream_max_mb << 20)
        self._held = PeerReplicas()  # the replicas each peer has load on, in our view
        self._dropped = DroppedEntries(self.key.decode(), self.member)  # said once a kind

    def wake(self) -> None:
        """Publish now (a request ended: its load must not linger in peers' views)."""
        self._wake.set()

    def _urge(self) -> None:
        self._urged.set()
        self._wake.set()

    def _set_calm(self, calm: bool) -> None:
        if calm:
            self._calm.set()
            self._go.set()
        else:
            self._calm.clear()

    @property
    def degraded(self) -> bool:
        return not self.stats.up

    @property
    def down_cause(self) -> str | None:
        """While degraded: why (one of `redis_conn.CAUSE_LABELS`)."""
        cause = self.reach.cause
        return None if self.stats.up or cause is None else cause_label(cause)

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Catch up on the recent past (best effort), then start publishing and reading."""
        log.info("shared routing state: connecting to Redis at %s", self.reach.address,
                 extra={"member": self.member, "redis": self.reach.address})
        try:
            peers = await self._catch_up()
            self.stats.up = True
            # Redis answered: a later failure is an outage, not a URL that never worked (whose
            # first reset was read as a TLS-only port: "rediss:// in KVGATE_REDIS_URL?")
            self.reach.answered()
            log.info("shared routing state on (%d peer%s)", peers, "" if peers == 1 else "s",
                     extra={"member": self.member, "redis": self.reach.address})
        except (RedisError, OSError) as exc:
            self._down(exc)
        slot = current_slot()
        if slot is not None:  # a worker: its supervisor says its goodbye if it is killed
            member_note(slot.directory, slot.slot).write(self.member)
        self._tasks = [
            asyncio.create_task(self._publish_loop(), name="kvgate-sync-publish"),
            asyncio.create_task(self._read_loop(), name="kvgate-sync-read"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            while not task.done():  # a library may swallow a cancellation: ask again
                await asyncio.wait({task}, timeout=1.0)
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.stats.up:  # say goodbye so peers drop our load now, not after the timeout
            with contextlib.suppress(RedisError, OSError):
                await self._xadd(encode(self.member, time.time(), [], {}, bye=True))
        await self._out.close()
        await self._in.close()

    # -- publishing ---------------------------------------------------------------------------
    def _batch(self, now: float) -> dict[bytes, bytes] | None:
        routes = self._router.drain_outbox()
        changed = self._load.changes(self._own_loads(), now, bool(routes))
        if changed is None:
            return None
        return encode(self.member, time.time(), routes, changed, whole=self._load.whole)

    def _xadd_args(self, fields: dict[bytes, bytes]) -> tuple[bytes | int, ...]:
        return (b"XADD", self.key, b"MAXLEN", b"~", self._budget.trim_to(fields), b"*",
                *(x for kv in fields.items() for x in kv))

    async def _xadd(self, fields: dict[bytes, bytes]) -> None:
        await self._out.call(*self._xadd_args(fields))

    async def _publish_loop(self) -> None:
        """A batch at once when the router queued a route or a request ended and the last
        batch is older than the flush interval (a quiet gateway publishes without delay, so a
        client's next turn finds every gateway informed); under load, one batch per flush
        interval, so batches grow with the load and Redis calls do not.

        While peers hold some load of ours (requests in flight here) the publisher also
        ticks every interval, for load changes a first token does not wake it for, and it
        then reads too: the new entries come back in the same round trip as its batch (an
        XREAD pipelined after the XADD), and the reader stands by. A busy gateway makes one
        Redis call per interval, however many requests and peers there are."""
        loop = asyncio.get_running_loop()
        interval, heartbeat = self.settings.flush_interval_s, self.settings.heartbeat_s
        gap = self.settings.urgent_gap_s
        wake, urged = self._wake, self._urged
        last = float("-inf")
        while True:
            if not (wake.is_set() or self._load.published):  # quiet: a wake or the heartbeat
                tick = loop.call_later(
                    max(interval, self._load.last_beat + heartbeat - self._clock()), wake.set)
                await wake.wait()
                tick.cancel()
            early = last + interval - loop.time()
            if early > 0 and not urged.is_set():  # the next tick (a wake meanwhile waits
                with contextlib.suppress(TimeoutError):  # for it, an urgent route does not)
                    async with asyncio.timeout(early):
                        await urged.wait()
            if urged.is_set() and (soon := last + gap - loop.time()) > 0:
                await asyncio.sleep(soon)  # one urgent batch per gap: the others join it
            wake.clear()
            urged.clear()
            last = loop.time()
            fields = self._batch(self._clock())
            reads = bool(self._load.published) and self.stats.up
            self._set_calm(not reads)
            if not reads and fields is None:
                continue
            commands = [self._xadd_args(fields)] if fields is not None else []
            if reads:
                commands.append((b"XREAD", b"COUNT", self.settings.max_entries_per_tick,
                                 b"STREAMS", self.key, self._last_id))
            sent = self._redis_clock.clock()
            try:
                replies = await self._out.pipeline(*commands)
            except (RedisError, OSError) as exc:
                if fields is not None and b"r" in fields:
                    self.stats.drop("unpublished", 1)
                self._write_failed = True
                self._load.forget()  # re-send the whole load once Redis is back
                self._down(exc)
                self._set_calm(True)  # the reader finds out when Redis is back
                await asyncio.sleep(RETRY_S)
                continue
            if fields is not None:
                self.stats.published += 1
                self._write_failed = False
                self._check_order(replies[0])
                self._redis_clock.sample(sent, self._redis_clock.clock(), replies[0])
            self._answered()
            if reads:
                self._take(replies[-1])

    # -- reading ------------------------------------------------------------------------------
    async def _catch_up(self) -> int:
        """Apply the routes of the recent entries (their loads are old: not applied); the
        number of peers among them that wrote within ``stale_after_s``, by Redis's clock
        (its TIME against the entries' ids: a peer's clock may be off, ours too)."""
        n = self.settings.catchup_entries
        now: int | None = None
        if n:
            now = await self._redis_time_ms()
            found = entries(await self._in.call(b"XREVRANGE", self.key, b"+", b"-", b"COUNT", n))
        else:  # nothing to catch up on, but "on" must mean that Redis answered
            await self._in.call(b"PING")
            found = []
        if not found:
            self._last_id, self._last_key = b"0-0", (0, 0)  # an empty stream: from its start
            return 0
        self._last_id, self._last_key = found[0][0], entry_key(found[0][0])
        recent = (entry_ms(found[0][0]) if now is None else now) - self._stale_ms
        live: set[str] = set()
        for entry_id, fields in reversed(found):
            batch = self._decode(fields)
            if batch is not None and batch.member != self.member:
                self._apply_routes(batch, live=False)  # history: no context is live by it
                if batch.bye:
                    live.discard(batch.member)
                elif entry_ms(entry_id) >= recent:
                    live.add(batch.member)
        return len(live)

    async def _redis_time_ms(self) -> int | None:
        """Redis's clock (TIME), or None where TIME is refused (an ACL user without it, a
        hardened configuration that renamed it away): the catch-up then judges the peers by
        the stream's newest entry. Asked on its own, not pipelined with the entries: an
        error reply fails a whole pipeline (the catch-up failed at every start, "cannot
        reach Redis", and the stream was read from its start instead, history as live)."""
        try:
            return time_ms(await self._in.call(b"TIME"))
        except ResponseError:  # unknown command, NOPERM; a connection error is raised
            return None

    async def _read_loop(self) -> None:
        """Blocks on XREAD while the publisher does not read (a gateway with nothing in
        flight: the first entry after a quiet spell is applied at once); at most one read per
        flush interval (every entry written meanwhile comes back in one reply, our own too:
        one stream); a full read (a backlog) is followed by the next at once, after yielding
        to the event loop. While a pick is held here (`Router.holding`) it reads at once,
        whatever the publisher does, each XREAD blocking until the next entry or the hold's
        end: a peer's pick of the same instant, published at once, is applied about a round
        trip after its pick, not an interval or two."""
        loop = asyncio.get_running_loop()
        interval = self.settings.flush_interval_s
        count = self.settings.max_entries_per_tick
        calm, go = self._calm, self._go
        last = float("-inf")
        while True:
            go.clear()
            held = self._router.held_until - self._clock()
            if held > 0:
                block_ms = max(1, min(_BLOCK_MS, math.ceil(held * 1000)))
            elif not calm.is_set():
                await go.wait()  # the publisher reads (pipelined with its batches)
                continue
            elif (early := last + interval - loop.time()) > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(early):
                        await go.wait()  # (a pick held meanwhile is read for at once)
                continue
            else:
                block_ms = _BLOCK_MS
            last = loop.time()
            try:
                reply = await self._in.call(b"XREAD", b"COUNT", count, b"BLOCK", block_ms,
                                            b"STREAMS", self.key, self._last_id)
                if not self.stats.up:
                    self._wake.set()  # the publisher re-sends our load
                    if not self._write_failed:  # (else its next write decides)
                        self._answered()
            except (RedisError, OSError) as exc:
                self._down(exc)
                await asyncio.sleep(RETRY_S)
                continue
            if self._take(reply) >= count:
                last = float("-inf")  # a backlog: read on after this turn
            await asyncio.sleep(0)  # bounded work per tick: let requests run between reads

    def _take(self, reply: object) -> int:
        """Apply the entries of an XREAD reply not applied yet (the reader's and the
        publisher's reads may overlap); how many it held."""
        held = 0
        for _, raw in reply or ():  # type: ignore[attr-defined]
            held += len(raw)
            # Redis's time now, as our writes taught it; before they did, the reply's newest
            # entry's (a reader cut off for longer than the staleness bound and given only
            # old entries in one reply read them all as current by it: a peer killed
            # meanwhile came back to life with its last load for another stale_after_s)
            now = self._redis_clock.now_ms()
            recent = (entry_ms(raw[-1][0]) if now is None else now) - self._stale_ms
            own = self._member
            for entry_id, flat in raw:
                key = entry_key(entry_id)
                if key <= self._last_key:
                    continue  # applied by the other loop's read
                self._last_id, self._last_key = entry_id, key
                if len(flat) > 3 and flat[3] == own and flat[2] == b"m":
                    continue  # our own batch, skipped undecoded (`encode` writes v, m, ..)
                # loads older than the staleness bound (a backlog after an outage, a
                # reader cut off) are history: their routes count, their loads do not
                self._apply(dict(zip(flat[::2], flat[1::2], strict=True)), key[0],
                            key[0] >= recent)
        return held

    def _decode(self, fields: Mapping[bytes, bytes]) -> Batch | None:
        try:
            return decode(fields)
        except UnknownVersion:
            self.stats.drop("version")
            self._dropped.said(fields, "version")
        except BadRecord:
            self.stats.drop("malformed")
            self._dropped.said(fields, "malformed")
        return None

    def _apply(self, fields: Mapping[bytes, bytes], written_ms: int,
               current: bool = True) -> None:
        batch = self._decode(fields)
        if batch is None or batch.member == self.member:
            return
        router = self._router
        if batch.bye:
            if router.peers is not None:
                router.peers.drop(batch.member)
            self._held.drop(batch.member)
            self.stats.applied += 1
            return
        self._apply_routes(batch, live=current)
        self.stats.applied += 1
        if not current:
            return
        known, now = self._known, self._clock()
        loads = {k: v for k, v in batch.loads.items() if known(k)}
        # a heartbeat's whole load: the replicas it leaves out are zero (`PeerReplicas`)
        router.apply_peer_load(batch.member, self._held.complete(batch.member, loads,
                                                                 batch.whole), now)
        peers = router.peers  # (peers gone for good are forgotten now and then)
        if batch.whole and peers is not None and len(self._held) > 8 + 2 * peers.members(now):
            self._held.keep_only(peers.member_ids(now))
        lag = self._redis_clock.lag(written_ms)  # not the writer's clock against ours
        if lag is not None:
            self.stats.lag(lag)

    def _apply_routes(self, batch: Batch, live: bool) -> None:
        known, routes = self._known, batch.routes
        if not all(map(known, {r.replica for r in routes})):  # asked once per replica
            routes = [r for r in routes if known(r.replica)]
            self.stats.drop("foreign", len(batch.routes) - len(routes))
        if routes:
            self._router.apply_peer_routes(routes, batch.member, self._clock(), live)

    def _check_order(self, own_id: object) -> None:
        """Ids of one stream only grow: our entry's id below our previous one's means the
        stream is a new one behind the one we read (a Redis that lost its state, on a clock
        behind the old server's). XREAD after the last id read would return nothing until
        the new clock caught up, the sharing "up" all along: read the new one from its
        start, and learn the new server's clock afresh."""
        if not isinstance(own_id, bytes):
            return
        key, last = entry_key(own_id), self._last_own
        self._last_own = key
        if key < last:
            log.warning("shared routing state: the stream restarted behind the last entry "
                        "read; reading it from its start",
                        extra={"member": self.member, "redis": self.reach.address})
            self._last_id, self._last_key = b"0-0", (0, 0)
            self._redis_clock.forget()  # learned from the old server's ids

    def _answered(self) -> None:
        if not self.stats.up:
            self.reach.answered()
            self.stats.up = True

    def _down(self, exc: BaseException) -> None:
        """A failed Redis call: route on our own state until Redis answers again. The first
        batch after it re-sends our whole load, zeros included: a request that ended while
        Redis was down (or whose zero record a restarted Redis lost) would otherwise stay in
        the peers' views for as long as we live, our heartbeats keeping it fresh. Redis's
        clock is learned afresh from that batch (a restarted server's may be behind: entries
        read meanwhile are judged by the newest of their reply, not as old history)."""
        cause = failure_cause(exc)
        if cause == WRONG_TYPE:  # our one key: say which, retrying will not cure it
            cause += f": {self.key.decode()} is not a stream (delete it)"
        self.reach.failed(cause)
        self.stats.up = False
        self._load.resend_all = True
        self._redis_clock.forget()
