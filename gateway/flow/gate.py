"""Flow control in the gateway: a thin asyncio wrapper around the pure core (`routing.flow`).

`FlowGate.admit` runs after the request is admitted against its tenant's limits and before the
router picks a replica (`Preparer.prepare`). It plans the pool; while the pool has room and
nothing waits for it the request passes straight through (one saturation check over the
pool's views, other gateways' load added: work-conserving, no reordering). Otherwise the
tier's spill-over is tried first (the planner, with the saturated pool avoided), then the
request waits in the pool's queue (`PoolFlow`: priority bands, fair shares in tokens, bounds)
until the pump releases it, and it is planned again with fresh views.

The pump runs when a request is queued and every ``flow.tick_ms`` while anything is queued (a
first token, a finished request, a fresh scrape or another gateway's record can each free
room). It releases one request at a time: the released request is picked a replica before
the next check (`_landed`, scheduled behind it) and counts there from then on (its lease is
taken in the turn of its pick, `gateway/proxy.py`), so one free slot lets out one request.

Every request sent to a pool counts against its tenant's share of the pool's in-flight tokens
until it is over (``req.flow_done``, called by `Preparer.finish`; it then keeps what it used and
gives back the rest, `FlowGate._done`): a tenant over its share is passed over, and one over it
in what it sent lately too goes only to a replica with spare room (the share cap,
`routing.flow.gate`; `_narrow` routes it there). The share is this gateway's:
with several gateways behind a balancer each sees its part of every tenant.

With other gateways (shared state) the saturation rule adds their published load and, within
their records' lag (`PeerLag`), what they may have sent unseen: as many as this gateway sent
itself per replica, from each of them (`routing.flow.unseen`; `mark` records every pick), so
a burst split over N gateways fills the bounds, not N times them. A band below the policy's
top one takes a pool's room only once it has lasted two such lags (`_held_above`): a slot
freed here is seen here first, and a top-band request queued on another gateway gets it (a
band owed its minimum share waits two lags from when it was first held, then takes its turn).

A queued request holds its concurrency lease (it counts once, as it did before queueing) and
no replica counter. It leaves the queue released, shed (429 with Retry-After past its tier's
``max_wait_s`` or displaced from a full queue; 503 when the queue is full of requests at least
as important as a top-band one: the pool is overloaded), moved (a policy change sends it to
another pool: it is admitted again there, within the deadline of its first queue,
`FlowGate.policy_changed`), abandoned (its client disconnected: removed at once and counted,
the edge settles the admission; the HTTP edge's disconnect watch signals it, the picker's
handler is cancelled by gRPC; one released while its client's FIN is being probed waits for
the probe's answer, `ClientWatch`), or interrupted when shutdown starts (503: not sent
during the grace).
`x-kvgate-route: queued` and the request line's ``queued_ms`` mark a request that waited.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from functools import partial
from time import perf_counter
from typing import Any

from gateway.body import ParsedBody
from gateway.config import FlowSection
from gateway.drain import interruptible, waiting
from gateway.errors import (
    AuthError,
    KvgateError,
    PermissionDenied,
    PoolOverloaded,
    QueueShed,
    ShutDownWhileQueued,
)
from gateway.flow.cost import asked_tokens
from gateway.flow.metrics import FlowMetrics
from gateway.halfclose import EOF_PROBE, REPROBE_S
from gateway.metrics import GatewayMetrics
from gateway.planner import Plan, Planner
from gateway.policy_doc import PolicyDoc
from gateway.pool import Pool, Pools
from gateway.request import ProxiedRequest
from gateway.tenancy.models import PolicySnapshot
from gateway.tenancy.resolver import Principal
from routing.flow import RETRY_AFTER_MAX_S, Entry, FlowConfig, PoolFlow, Saturation
from routing.flow.unseen import UnseenPicks
from routing.peers import ReplicaLoad
from routing.router import Router
from routing.types import Decision, ReplicaView

__all__ = ["ClientWatch", "FlowGate", "until_disconnect"]

_NO_PEERS: Mapping[str, ReplicaLoad] = {}
QUEUED = "queued"  # the route of a request that waited
_CHECK_KEYS_S = 0.5  # how often the keys of a pool's queued requests are looked up


class _Gone(Exception):
    """The queued request's client disconnected."""


async def until_disconnect(receive: Callable[[], Awaitable[Any]]) -> None:
    """Returns when the ASGI client disconnects (the body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientWatch:
    """A queued request's client at the HTTP edge: called, returns when it has left
    (`until_disconnect`); `probing`: the answer to come of the probe of a FIN it sent, while
    it is not known whether it left or only half-closed its side (`gateway.halfclose`)."""

    __slots__ = ("_receive", "_scope")

    def __init__(self, receive: Callable[[], Awaitable[Any]], scope: Mapping[str, Any]) -> None:
        self._receive, self._scope = receive, scope

    async def __call__(self) -> None:
        await until_disconnect(self._receive)

    def probing(self) -> asyncio.Future[bool] | None:
        probe: asyncio.Future[bool] | None = self._scope.get("extensions", {}).get(EOF_PROBE)
        return probe if probe is not None and not probe.done() else None


async def _left(gone: Callable[[], Awaitable[object]], watch: asyncio.Future[object]) -> bool:
    """Whether the client of a request just released from the queue has left: its watch saw
    it go (the queue's removal of it had not run yet), or it sent a FIN whose probe says so
    (waited for: a slot that freed as it left would otherwise send it to a replica)."""
    probe = gone.probing() if isinstance(gone, ClientWatch) else None
    if probe is not None and not watch.done():
        await asyncio.wait((probe, watch), timeout=REPROBE_S,
                           return_when=asyncio.FIRST_COMPLETED)
    if watch.done() and not watch.cancelled():
        return True
    return probe is not None and probe.done() and probe.result() is False


class _Ticket:
    """One queued request's handle: its future (True: moved to another pool by a policy
    change, `move`; False: released), who sent it (its key's hash: whether it is still
    valid), for which model and how much context it takes (``need``: where a policy change
    sends it, a prompt too long for a pool skipping it), when it was first queued
    (``since``: a move does not restart its wait), how many requests its pool had been sent
    when it was queued there (``sends``: whether anything went while it waited) and, once
    offered, its queue entry."""

    __slots__ = ("entry", "fut", "key_hash", "model", "need", "principal", "sends", "since",
                 "state")

    def __init__(
        self, fut: asyncio.Future[bool], principal: Principal, key_hash: str | None,
        model: str, need: int, since: float, sends: int,
    ) -> None:
        self.fut = fut
        self.principal, self.key_hash = principal, key_hash
        self.model, self.need, self.since = model, need, since
        self.sends = sends
        self.entry: Entry[_Ticket] | None = None
        self.state: _PoolState | None = None

    def move(self) -> None:
        """Out of its queue, to be admitted again where the policy in force sends it."""
        if self.entry is not None and self.state is not None and self.entry.queued:
            self.state.flow.remove(self.entry)
            if not self.fut.done():
                self.fut.set_result(True)

    def fail(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)

    def fire(self, reason: str) -> None:
        """Shutdown started (`gateway.drain.interrupt_waiting`; for a request queued after
        that, the grace is over: `interrupt_all`)."""
        if self.entry is not None and self.state is not None:
            self.state.flow.remove(self.entry)
        self.fail(ShutDownWhileQueued("The gateway is shutting down; the request was not sent."))


class _PoolState:
    __slots__ = ("checked", "doc", "flow", "name", "owed_since", "room_since", "sends", "sent_at",
                 "timer", "transit")

    def __init__(self, name: str, flow: PoolFlow[_Ticket]) -> None:
        self.name = name
        self.flow = flow
        self.checked = -math.inf  # when its queued requests' keys were last looked up
        self.transit: _Ticket | None = None  # released, not yet on its replica
        self.timer: asyncio.TimerHandle | None = None
        self.doc: PolicyDoc | None = None  # the policy the shares were taken from
        self.sends = 0  # requests sent to the pool (straight, spilled or released)
        self.sent_at = -math.inf  # when the last of them was
        # since when it has had room (`_held_above`; None: it has none; from the start)
        self.room_since: float | None = -math.inf
        # since when a lower band owed its minimum share has been held (`_held_above`)
        self.owed_since: float | None = None


class FlowGate:
    def __init__(
        self, cfg: FlowSection, pools: Pools, router: Router, planner: Planner,
        metrics: GatewayMetrics, clock: Callable[[], float],
        lag: Callable[[float], float] | None = None,
    ) -> None:
        """``lag``: how late other gateways' sends reach this one (`PeerLag`), when gateways
        share state."""
        self._cfg = cfg
        self._core = cfg.flow_config()
        self._tick = cfg.tick_ms / 1000.0
        self._expected = cfg.expected_output_tokens
        self._room_only = cfg.room_only
        self._pools = pools
        self._router = router
        self._planner = planner
        self._clock = clock
        self._states: dict[str, _PoolState] = {}
        self._lag = lag
        self._unseen = UnseenPicks()  # this gateway's recent picks (`peers`)
        self.metrics = FlowMetrics(metrics.registry, self._queues, self._saturation)
        metrics.pool_forgetters.append(self._forget_pool)

    # -- the hook -----------------------------------------------------------------------------
    async def admit(
        self, req: ProxiedRequest, principal: Principal, parsed: ParsedBody,
        gone: Callable[[], Awaitable[object]] | None = None,
    ) -> Plan:
        """The plan to pick a replica from, now or after waiting (see the module docstring).
        ``gone``: returns when the client has left (a queued request is then dropped). A
        policy change that sends a queued request to another pool moves it there: it is
        admitted again on the policy in force (`policy_changed`), within the deadline it got
        when first queued."""
        now = self._clock()
        plan = self._planner.plan(principal, parsed, req.kind, now)
        since: float | None = None  # when first queued: a move keeps its deadline
        deadline = math.inf
        while True:
            cost = self.cost_of(plan, parsed)
            state = self.state(plan.pool.name)
            sent = self._pass(req, principal, parsed, plan, state, cost, now)
            if sent is not None:
                return sent
            since = now if since is None else since
            kept = await self._wait(req, principal, parsed, plan.features.context_tokens,
                                    state, cost, now, gone, since, deadline)
            if kept is None:  # released
                break
            deadline = kept
            now = self._clock()  # moved: its pool changed while it waited
            principal = self._planner.gate.current(principal, req.key_hash)
            plan = self._planner.plan(principal, parsed, req.kind, now)
        now = self._clock()
        # planned again on the policy in force now (it may have changed while this waited)
        principal = self._planner.gate.current(principal, req.key_hash)
        plan = self._released(principal, parsed, req.kind, state, now)
        state = self.state(plan.pool.name)
        return self._narrow(state, plan, self.peers(now), principal.tenant_id, cost, now)

    def _released(
        self, principal: Principal, parsed: ParsedBody, kind: str, state: _PoolState, now: float,
    ) -> Plan:
        """The plan of a request ``state``'s pool released (it has room there, by this
        gate's rule): that pool's, unless the policy in force sends it elsewhere whatever the
        load (its pool removed or moved, or too short for its context) or the pool has no
        healthy replica (released to be answered elsewhere or 503 at once). Tier resolution's
        spill-over for load, which reads scraped levels only, sent it on to a pool that may
        have had no room, past its bound, counted in this one's."""
        plan = self._planner.plan(principal, parsed, kind, now)
        if plan.pool.name == state.name:
            return plan
        kept = self._planner.plan(principal, parsed, kind, now, avoid=(plan.pool.name,))
        if kept.pool.name == state.name and any(
                v.healthy for v in self.busy_full(state.name, kept.views, now)):
            return kept
        return plan

    def _pass(
        self, req: ProxiedRequest, principal: Principal, parsed: ParsedBody, plan: Plan,
        state: _PoolState, cost: float, now: float,
    ) -> Plan | None:
        """The plan when the request goes now: straight through, or spilled over to another
        pool with room; None when it has to wait in ``state``'s queue."""
        peers = self.peers(now)
        tenant = principal.tenant_id
        doc = self.doc(principal)
        band, weight, _ = doc.flow_class(principal.tier, tenant)
        views = self.busy_full(state.name, plan.views, now)
        held = self._held_above(state, views, peers, doc, now)
        if (held is None or band <= held) and state.flow.admit(
                views, cost, now, peers, tenant, weight):
            self._sent(state, req, tenant, cost)
            return self._narrow(state, plan, peers, tenant, cost, now)
        alt = self.spill(req.kind, principal, parsed, plan, now)
        if alt is None:
            return None
        alt_state = self.state(alt.pool.name)
        alt_state.flow.sent(tenant, cost, now, weight)
        self._sent(alt_state, req, tenant, cost)
        return self._narrow(alt_state, alt, self.peers(now), tenant, cost, now)

    def _narrow(
        self, state: _PoolState, plan: Plan, peers: Mapping[str, ReplicaLoad], tenant: str,
        cost: float, now: float,
    ) -> Plan:
        """The router picks only among the replicas with room for this prompt (when any; a
        tenant taking more than its share: with spare room, `PoolFlow.with_room`)."""
        if self._room_only:
            plan.views = state.flow.with_room(plan.views, peers, plan.features.prompt_tokens,
                                              tenant, cost, now)
        return plan

    def busy_full(self, pool: str, views: list[ReplicaView], now: float) -> list[ReplicaView]:
        """``views`` as the saturation rule takes them: a replica backing off after a busy
        503 (`Replica.busy`, health aside) is full, not gone. Marked unhealthy for the
        router, it left a pool whose replicas had all answered busy without a healthy one:
        not saturated, so every queued request went at once and got the proxy's 503."""
        replicas = self._pools.by_name.get(pool)
        if replicas is None:
            return views
        out = views
        for i, view in enumerate(views):
            r = None if view.healthy else replicas.by_id.get(view.id)
            if r is not None and r.busy(now) and r.available(now):
                out = list(out) if out is views else out
                out[i] = replace(view, healthy=True, waiting=math.inf)  # full: "waiting"
        return out

    def mark(self, req: ProxiedRequest, decision: Decision) -> Decision:
        """``decision``, picked for ``req`` now, with the route "queued" when the request
        waited. With other gateways, the pick is kept for as long as their records of what
        they sent meanwhile may take to arrive (`peers`)."""
        if self._lag is not None:
            now = self._clock()
            self._unseen.window = self._lag(now)
            self._unseen.picked(decision.replica, req.features.prompt_tokens, now)
        if req.queued_s is None or req.spilled:
            return decision
        return Decision(decision.replica, decision.fallbacks, QUEUED, decision.ranked)

    def spill(
        self, kind: str, principal: Principal, parsed: ParsedBody, plan: Plan, now: float,
    ) -> Plan | None:
        """The tier's other pool, tried before queueing: a plan for another pool with room
        and nothing queued -- its spill-over (`spill_to`, `borrow_from`) from its home pool,
        or its home pool from the pool tier resolution spilled it to for load (that reads
        the replicas' scraped levels only: a spill pool full of kvgate's own requests, its
        engine's queue empty, took requests into its queue while home had room). A request
        spilled for its context stays (the other pool is too short for it)."""
        doc = self.doc(principal)
        tier = doc.tiers.get(principal.tier)
        if tier is None or (tier.spill_to is None and tier.borrow_from is None):
            return None
        alt = self._planner.plan(principal, parsed, kind, now, avoid=(plan.pool.name,))
        if alt.pool is plan.pool:
            return None
        other = self.state(alt.pool.name)
        views = self.busy_full(other.name, alt.views, now)
        # (a pool with no healthy replica is not saturated: it answers 503 at once)
        if other.flow.queue or other.flow.saturated(views, self.peers(now)) or not any(
                v.healthy for v in views):
            return None
        return alt

    async def _wait(
        self, req: ProxiedRequest, principal: Principal, parsed: ParsedBody, need: int,
        state: _PoolState, cost: float, now: float,
        gone: Callable[[], Awaitable[object]] | None, since: float, deadline: float,
    ) -> float | None:
        """Queued in ``state``'s pool until released (None) or moved to another pool by a
        policy change (its deadline, which it keeps there); raises when shed, abandoned or
        interrupted. Its deadline: its tier's ``max_wait_s`` from now, or ``deadline`` (the
        one it got where it was first queued, ``since``) when that comes first, so a move
        does not restart its wait."""
        doc = self.doc(principal)
        self._shares(state, doc)
        band, weight, max_wait = doc.flow_class(principal.tier, principal.tenant_id)
        max_wait = min(max_wait, deadline - now)  # past it: shed at the pump's next look
        req.pool_name = state.name  # shed or abandoned, it is counted under this pool
        loop = asyncio.get_running_loop()
        ticket = _Ticket(loop.create_future(), principal, req.key_hash, parsed.model, need,
                         since, state.sends)
        offer = state.flow.offer(ticket, tenant=principal.tenant_id, band=band, cost=cost,
                                 now=now, max_wait_s=max_wait, weight=weight, tier=req.tier)
        for evicted in offer.evicted:
            self._shed(state, evicted, "queue_full", now)
        if offer.entry is None:
            req.route = "shed"
            self.metrics.child(self.metrics.shed, state.name, req.tier, "queue_full").inc()
            raise self._full(state, band, doc, now)
        ticket.entry, ticket.state = offer.entry, state
        self.metrics.child(self.metrics.queued, state.name, req.tier).inc()
        loop.call_soon(self._pump, state)
        watch: asyncio.Future[object] | None = None
        if gone is not None:
            watch = asyncio.ensure_future(gone())

            def left(task: asyncio.Future[object]) -> None:
                if not task.cancelled():
                    self._left(state, ticket)

            watch.add_done_callback(left)
        t0 = perf_counter() - (req.queued_s or 0.0)  # (it may have waited in another pool)
        released = moved = False
        outcome = ""  # how it left the queue (`kvgate_flow_dequeued_total`)
        try:
            with interruptible(ticket), waiting(ticket):  # answered when shutdown starts
                moved = await ticket.fut
                if not moved and watch is not None and gone is not None \
                        and await _left(gone, watch):
                    # released as its client left: never sent, and it took nothing
                    state.flow.refund(principal.tenant_id, cost, self._clock(), ticket.entry)
                    raise _Gone
            released = not moved
            outcome = "released" if released else "moved"
            if released:
                self._sent(state, req, principal.tenant_id, cost, ticket.entry)
        except _Gone:
            outcome = "abandoned"
            self._abandoned(state, req, t0)
            raise asyncio.CancelledError from None  # the proxy records 499 and settles
        except asyncio.CancelledError:
            # the picker's: gRPC cancels the exchange whose client left (Envoy ended its
            # stream) where the HTTP edge signals it (`_Gone`); counted alike while queued
            if ticket.entry.queued:
                outcome = "abandoned"
                self._abandoned(state, req, t0)
            else:  # it had left the queue already, released or moved
                outcome = "released" if ticket.entry.dispatched else "moved"
            raise
        except ShutDownWhileQueued:
            outcome = "interrupted"
            req.queued_s = perf_counter() - t0
            req.route = "interrupted"
            raise
        except (AuthError, PermissionDenied):  # its key revoked meanwhile (`_check_keys`)
            outcome = "refused"
            req.queued_s = perf_counter() - t0
            raise
        except KvgateError:
            outcome = "shed"
            req.queued_s = perf_counter() - t0
            req.route = "shed"
            raise
        finally:
            if watch is not None:
                watch.cancel()
            if ticket.entry.queued:  # cancelled from outside while queued
                state.flow.remove(ticket.entry)
            if not released and ticket.entry.dispatched:  # released, then cancelled
                state.flow.done(principal.tenant_id, cost)
                if state.transit is ticket:
                    state.transit = None
                    loop.call_soon(self._pump, state)
            if outcome:
                self.metrics.child(self.metrics.dequeued, state.name, req.tier, outcome).inc()
        req.queued_s = waited = perf_counter() - t0
        if moved:
            return ticket.entry.deadline
        self.metrics.child(self.metrics.wait, req.tier).observe(waited)
        # the pump looks again once this request has its replica (after this task's step)
        loop.call_soon(self._landed, state, ticket)
        return None

    def _abandoned(self, state: _PoolState, req: ProxiedRequest, t0: float) -> None:
        """Its client left while it was queued (the caller records 499 and settles)."""
        req.queued_s = perf_counter() - t0
        self.metrics.child(self.metrics.abandoned, state.name, req.tier).inc()

    def _left(self, state: _PoolState, ticket: _Ticket) -> None:
        """The client disconnected while queued: out of the queue now, not at its turn."""
        if ticket.entry is not None and ticket.entry.queued:
            state.flow.remove(ticket.entry)
        ticket.fail(_Gone())

    def _landed(self, state: _PoolState, ticket: _Ticket) -> None:
        if state.transit is ticket:
            state.transit = None
        self._pump(state)

    def policy_changed(self, snap: PolicySnapshot) -> None:
        """A new policy version (`TenancyResolver.on_policy`, once the pools follow it): each
        queued request it sends to another pool than the one its own policy does leaves its
        queue and is admitted again there (`admit`). Left queued, it waited for its old pool
        (saturated, perhaps for long: until its ``max_wait_s`` shed it) while new requests
        went to the new one (a pool the policy removed: its queue went through at once, to
        its new pool whether saturated or not)."""
        now = self._clock()
        planner = self._planner
        for state in list(self._states.values()):
            state.flow.set_saturation(self._rule(state.name, snap.doc))
            if state.flow.queue:  # a bound raised: room for what waits now, not at a tick
                asyncio.get_running_loop().call_soon(self._pump, state)
            for entry in list(state.flow.queue.entries()):
                ticket = entry.handle
                then = planner.pool_for(ticket.principal, ticket.model, now, ticket.need)
                moved = replace(ticket.principal, policy=snap)
                if planner.pool_for(moved, ticket.model, now, ticket.need) != then:
                    ticket.move()

    # -- the pump ---------------------------------------------------------------------------
    def _pump(self, state: _PoolState) -> None:
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
        flow = state.flow
        now = self._clock()
        for entry in flow.expire(now):
            self._shed(state, entry, "max_wait", now)
        if now - state.checked >= _CHECK_KEYS_S:
            state.checked = now
            self._check_keys(state)
        pool = self._pools.by_name.get(state.name)
        while state.transit is None and flow.queue:
            if pool is None:  # the pool left the policy: let them through to be re-planned
                out = flow.pop(now)
            else:
                views = self.busy_full(state.name, [r.view(now) for r in pool.replicas], now)
                peers = self.peers(now)
                held = (None if state.doc is None
                        else self._held_above(state, views, peers, state.doc, now))
                out = flow.release(views, now, peers, held)
            if out is None:
                break
            if state.owed_since is not None and flow.queue.owed() is None:
                state.owed_since = None  # paid: a band owed again waits its two lags again
            ticket = out.handle
            if ticket.fut.done():
                flow.done(out.tenant, out.cost)  # never sent
                continue
            state.transit = ticket
            ticket.fut.set_result(False)
        if flow.queue:
            state.timer = asyncio.get_running_loop().call_later(self._tick, self._pump, state)

    def _held_above(
        self, state: _PoolState, views: list[ReplicaView], peers: Mapping[str, ReplicaLoad],
        doc: PolicyDoc, now: float,
    ) -> int | None:
        """The policy's top band while the bands below it wait for room the pool has had
        only briefly (None: no band waits): with other gateways live, a band below the top
        one goes into a pool that had no room only once it has had room for two of their
        records' lags. A slot freed here is seen here at once, by the others a lag later; a
        higher-band request queued there is picked then and its record is back here a lag
        after: the slot is its. Without the wait the gateway where the slot freed filled it
        with its own queue's lower band, again and again, while a premium request waited on
        another gateway. The top band's requests queued here go meanwhile, even behind a
        lower band owed its minimum share (which stays owed), but only for two lags from when
        that band was first held owed (`_owed_waited`)."""
        if self._lag is None or state.flow.saturated(views, peers):
            state.room_since = None
            return None
        if state.room_since is None:
            state.room_since = now
        peers_live = self._router.peers
        if peers_live is None or not peers_live.members(now) or not doc.tiers:
            return None
        lags = 2.0 * self._lag(now)
        if now - state.room_since >= lags or self._owed_waited(state, now, lags):
            return None
        return min(doc.flow_class(t, "")[0] for t in doc.tiers)

    def held_band(
        self, state: _PoolState, views: list[ReplicaView], peers: Mapping[str, ReplicaLoad],
        doc: PolicyDoc, now: float,
    ) -> int | None:
        """What `_held_above` would say for a request arriving now, nothing changed (explain:
        it said a lower band's request would not queue while dispatch held it two lags)."""
        if self._lag is None or state.flow.saturated(views, peers):
            return None
        since = now if state.room_since is None else state.room_since
        peers_live = self._router.peers
        if peers_live is None or not peers_live.members(now) or not doc.tiers:
            return None
        lags = 2.0 * self._lag(now)
        owed = state.flow.queue.owed() is not None and state.owed_since is not None
        if now - since >= lags or (owed and now - (state.owed_since or now) >= lags):
            return None
        return min(doc.flow_class(t, "")[0] for t in doc.tiers)

    def _owed_waited(self, state: _PoolState, now: float, lags: float) -> bool:
        """Whether a band owed its minimum share has waited ``lags`` since it was first held
        owed: then it takes its turn. Waiting for room that lasts two lags, it never got one
        while the top band stayed backlogged here (each slot was the top band's at once):
        two gateways' free band was served 2.5 % of the tokens against its 10 % floor."""
        if state.flow.queue.owed() is None:
            state.owed_since = None
            return False
        if state.owed_since is None:
            state.owed_since = now
        return now - state.owed_since >= lags

    def _check_keys(self, state: _PoolState) -> None:
        """A queued request whose key was revoked or tenant deleted is answered 401 now (403:
        its tier left the policy; a dictionary lookup each, no I/O: `TenantGate.current`),
        not when its turn comes: where the pool stayed saturated it waited out its
        ``max_wait_s`` to be shed with a 429 its SDK retries. One whose tenant was moved to
        another tier is admitted again on it (its pool, its band), as for a policy change:
        it waited for its old tier's pool, perhaps until shed, while its tenant's new
        requests went where the new tier is served."""
        current = self._planner.gate.current
        for entry in list(state.flow.queue.entries()):
            ticket = entry.handle
            try:
                now = current(ticket.principal, ticket.key_hash)
            except (AuthError, PermissionDenied) as exc:  # (a store too stale to say, a 503:
                state.flow.remove(entry)  # left to its turn, as it may be fresh again then)
                ticket.fail(exc)
                continue
            except KvgateError:
                continue
            if now.tier != ticket.principal.tier and self._elsewhere(state, entry, now):
                ticket.move()

    def _elsewhere(self, state: _PoolState, entry: Entry[_Ticket], principal: Principal) -> bool:
        """Whether a queued request would wait in another pool or band as ``principal``."""
        at = self._clock()
        ticket = entry.handle
        if self._planner.pool_for(principal, ticket.model, at, ticket.need) != state.name:
            return True
        return self.doc(principal).flow_class(principal.tier, principal.tenant_id)[0] != entry.band

    def _shed(self, state: _PoolState, entry: Entry[_Ticket], reason: str, now: float) -> None:
        self.metrics.child(self.metrics.shed, state.name, entry.tier, reason).inc()
        what = ("waited longer than its tier allows" if reason == "max_wait"
                else "was displaced from a full queue")
        waited = now - entry.handle.since
        retry = state.flow.queue.retry_after(entry.band, now, waited)
        if state.sends == entry.handle.sends:
            # nothing went to the pool while it waited: the queue has not moved for that
            # long (the decayed rate of what went before read a drain of the queue left
            # ahead of it, nothing for the last one shed: 1 s, to a stalled pool)
            retry = max(retry, min(RETRY_AFTER_MAX_S, math.ceil(waited)))
        entry.handle.fail(QueueShed(
            f"The model's replicas are saturated and this request {what}; retry after "
            f"{retry}s.", retry_after_s=retry))

    def _full(self, state: _PoolState, band: int, doc: PolicyDoc, now: float) -> KvgateError:
        """The refusal of a request of ``band`` at a full queue. Its Retry-After: at least
        as long as the queue has not moved (nothing sent while requests waited): the decayed
        rate of what went before a stall read a short drain, and a client refused at the
        door was told 1 s by a queue stalled for seconds (one shed from it, `_shed`, its
        wait), to come back at once and be refused again."""
        retry = state.flow.queue.retry_after(band, now)
        stalled = now - max(state.flow.queue.oldest(now), state.sent_at)
        retry = max(retry, min(RETRY_AFTER_MAX_S, math.ceil(stalled)))
        top = min((doc.flow_class(t, "")[0] for t in doc.tiers), default=band)
        if band <= top:
            return PoolOverloaded(
                "The model's replicas are overloaded and the queue is full; retry after "
                f"{retry}s.", retry_after=retry)
        return QueueShed(
            f"The model's replicas are saturated and the queue is full; retry after {retry}s.",
            retry_after_s=retry)

    # -- state (read by gateway/flow/explain.py too) -------------------------------------------
    @property
    def core(self) -> FlowConfig:
        return self._core

    def doc(self, principal: Principal) -> PolicyDoc:
        """The policy ``principal`` was resolved under (the pools' when it carries none)."""
        return self._planner.doc(principal)

    def state(self, pool: str) -> _PoolState:
        state = self._states.get(pool)
        if state is None:
            flow: PoolFlow[_Ticket] = PoolFlow(self._core)
            flow.set_saturation(self._rule(pool, self._pools.doc))
            state = self._states[pool] = _PoolState(pool, flow)
        return state

    def _rule(self, pool: str, doc: PolicyDoc) -> Saturation:
        """``pool``'s saturation rule: the config's, with the policy's in-flight bound for
        it (``pools.<p>.max_inflight``, changed at run time) when the policy sets one."""
        cfg = doc.pools.get(pool)
        rule = self._core.saturation
        if cfg is None or cfg.max_inflight is None or cfg.max_inflight == rule.max_inflight:
            return rule
        return replace(rule, max_inflight=cfg.max_inflight)

    def _shares(self, state: _PoolState, doc: PolicyDoc) -> None:
        if state.doc is not doc:
            state.flow.queue.set_shares(doc.fairness.min_share, doc.fairness.default_min_share)
            state.doc = doc

    def peers(self, now: float) -> Mapping[str, ReplicaLoad]:
        """Other gateways' load per replica: their published records, and what they may have
        sent unseen within their records' lag, as many as this gateway sent there from each of
        them (`routing.flow.unseen`: a burst split over N gateways fills the bound, not N
        times it)."""
        peers = self._router.peers
        if peers is None:
            return _NO_PEERS
        totals = peers.totals(now)
        if not self._unseen:
            return totals
        return self._unseen.loads(totals, peers.members(now), now)

    def cost_of(self, plan: Plan, parsed: ParsedBody) -> float:
        return asked_tokens(parsed, plan.features.prompt_tokens, self._expected,
                            plan.pool.max_model_len)

    def _sent(
        self, state: _PoolState, req: ProxiedRequest, tenant: str, cost: float,
        entry: Entry[_Ticket] | None = None,
    ) -> None:
        """``req`` goes to ``state``'s pool: it holds ``cost`` tokens there until it is over
        (``entry``: its place in the queue, when it waited)."""
        state.sends += 1
        state.sent_at = self._clock()
        req.flow_done = partial(self._done, state, req, tenant, cost, entry)

    def _done(
        self, state: _PoolState, req: ProxiedRequest, tenant: str, cost: float,
        entry: Entry[_Ticket] | None,
    ) -> None:
        """``req`` is over: it keeps what it used (`ProxiedRequest.spent_tokens`: the real
        usage, else its prompt and the output relayed so far), never more than it was charged
        at its send, and gives the rest back. A stream its client stopped after the first
        event (a chat UI's stop button) or a replica cut, a request refused before any output
        (vLLM's 400 for a ``max_tokens`` beyond the context): the output charged at the send
        never ran, and must not push its tenant back in the fair-share order, nor count in
        the served tokens, for a while after. One that never reached a replica (the gateway
        refused it after flow control let it through, or its client left first) ran
        nothing: it is charged nothing."""
        charged = min(cost, float(max(0, req.spent_tokens())))
        if charged < cost:
            state.flow.refund(tenant, cost - charged, self._clock(), entry)
        state.flow.done(tenant, cost)
        self.metrics.child(self.metrics.tokens, state.name, req.tier, req.tenant).inc(charged)

    def pools(self) -> dict[str, _PoolState]:
        return self._states

    def _forget_pool(self, pool: str) -> None:
        """A pool a policy removed, once it has lingered: its series go, and its state when
        nothing is queued or in transit there (a state is made again if the pool comes back)."""
        self.metrics.forget_pool(pool)
        state = self._states.get(pool)
        if state is not None and not len(state.flow) and state.transit is None \
                and state.timer is None:
            del self._states[pool]

    def _queues(self) -> list[tuple[str, PoolFlow[_Ticket]]]:
        return [(name, state.flow) for name, state in self._states.items()]

    def _saturation(self) -> list[tuple[str, bool]]:
        now = self._clock()
        return [(pool.name, self.saturated(pool, now)) for pool in self._pools.by_name.values()]

    def saturated(self, pool: Pool, now: float) -> bool:
        state = self.state(pool.name)
        views = [r.view(now) for r in pool.replicas]
        return state.flow.saturated(self.busy_full(pool.name, views, now),
                                    self.peers(now))
