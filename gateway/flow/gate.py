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

`FlowGate` is built in layers, one module each: `ledger.py` (`FlowLedger`: the pools' states,
peers and what each request holds), `pump.py` (`FlowPump`: release, shedding, moves) and this
one (admission and waiting); `tickets.py` and `client_watch.py` hold what a queued request is
and how its client is watched.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping
from time import perf_counter

from gateway.body import ParsedBody
from gateway.drain import interruptible, waiting
from gateway.errors import AuthError, KvgateError, PermissionDenied, ShutDownWhileQueued
from gateway.flow.client_watch import ClientGone, ClientWatch, client_left, until_disconnect
from gateway.flow.pump import FlowPump
from gateway.flow.tickets import PoolState, Ticket
from gateway.planner import Plan
from gateway.request import ProxiedRequest
from gateway.tenancy.resolver import Principal
from routing.flow import Entry
from routing.peers import ReplicaLoad

__all__ = ["ClientWatch", "FlowGate", "until_disconnect"]


class FlowGate(FlowPump):
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
        self, principal: Principal, parsed: ParsedBody, kind: str, state: PoolState, now: float,
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
        state: PoolState, cost: float, now: float,
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
        self, state: PoolState, plan: Plan, peers: Mapping[str, ReplicaLoad], tenant: str,
        cost: float, now: float,
    ) -> Plan:
        """The router picks only among the replicas with room for this prompt (when any; a
        tenant taking more than its share: with spare room, `PoolFlow.with_room`)."""
        if self._room_only:
            plan.views = state.flow.with_room(plan.views, peers, plan.features.prompt_tokens,
                                              tenant, cost, now)
        return plan

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
        state: PoolState, cost: float, now: float,
        gone: Callable[[], Awaitable[object]] | None, since: float, deadline: float,
    ) -> float | None:
        """Queued in ``state``'s pool until released (None) or moved to another pool by a
        policy change (its deadline, which it keeps there); raises when shed, abandoned or
        interrupted. Its deadline: its tier's ``max_wait_s`` from now, or ``deadline`` (the
        one it got where it was first queued, ``since``) when that comes first, so a move
        does not restart its wait."""
        ticket, entry = self._enqueue(req, principal, parsed, need, state, cost, now, since,
                                      deadline)
        watch = self._watch(state, ticket, gone)
        t0 = perf_counter() - (req.queued_s or 0.0)  # (it may have waited in another pool)
        released = moved = False
        outcome = ""  # how it left the queue (`kvgate_flow_dequeued_total`)
        try:
            with interruptible(ticket), waiting(ticket):  # answered when shutdown starts
                moved = await ticket.fut
                if not moved and watch is not None and gone is not None \
                        and await client_left(gone, watch):
                    # released as its client left: never sent, and it took nothing
                    state.flow.refund(principal.tenant_id, cost, self._clock(), entry)
                    raise ClientGone
            released = not moved
            outcome = "released" if released else "moved"
            if released:
                self._sent(state, req, principal.tenant_id, cost, entry)
        except (ClientGone, asyncio.CancelledError, KvgateError) as exc:
            outcome = self._unqueued(exc, state, req, entry, t0)
            if isinstance(exc, ClientGone):
                raise asyncio.CancelledError from None  # the proxy records 499 and settles
            raise
        finally:
            if watch is not None:
                watch.cancel()
            if entry.queued:  # cancelled from outside while queued
                state.flow.remove(entry)
            if not released and entry.dispatched:  # released, then cancelled
                state.flow.done(principal.tenant_id, cost)
                if state.transit is ticket:
                    state.transit = None
                    asyncio.get_running_loop().call_soon(self._pump, state)
            if outcome:
                self.metrics.child(self.metrics.dequeued, state.name, req.tier, outcome).inc()
        req.queued_s = waited = perf_counter() - t0
        if moved:
            return entry.deadline
        self.metrics.child(self.metrics.wait, req.tier).observe(waited)
        # the pump looks again once this request has its replica (after this task's step)
        asyncio.get_running_loop().call_soon(self._landed, state, ticket)
        return None

    def _enqueue(
        self, req: ProxiedRequest, principal: Principal, parsed: ParsedBody, need: int,
        state: PoolState, cost: float, now: float, since: float, deadline: float,
    ) -> tuple[Ticket, Entry[Ticket]]:
        """``req`` offered to ``state``'s queue (see `_wait`), the pump told; raises the
        refusal of a full queue that it could displace nobody from."""
        doc = self.doc(principal)
        self._shares(state, doc)
        band, weight, max_wait = doc.flow_class(principal.tier, principal.tenant_id)
        max_wait = min(max_wait, deadline - now)  # past it: shed at the pump's next look
        req.pool_name = state.name  # shed or abandoned, it is counted under this pool
        loop = asyncio.get_running_loop()
        ticket = Ticket(loop.create_future(), principal, req.key_hash, parsed.model, need,
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
        return ticket, offer.entry

    def _watch(
        self, state: PoolState, ticket: Ticket, gone: Callable[[], Awaitable[object]] | None,
    ) -> asyncio.Future[object] | None:
        """A task that takes a queued request out of its queue once its client has left."""
        if gone is None:
            return None
        watch = asyncio.ensure_future(gone())

        def left(task: asyncio.Future[object]) -> None:
            if not task.cancelled():
                self._left(state, ticket)

        watch.add_done_callback(left)
        return watch

    def _unqueued(
        self, exc: BaseException, state: PoolState, req: ProxiedRequest, entry: Entry[Ticket],
        t0: float,
    ) -> str:
        """How a queued request that ``exc`` ended left the queue (`_wait`), its wait
        recorded: abandoned (its client left), interrupted, refused or shed."""
        if isinstance(exc, ClientGone):
            self._abandoned(state, req, t0)
            return "abandoned"
        if isinstance(exc, asyncio.CancelledError):
            # the picker's: gRPC cancels the exchange whose client left (Envoy ended its
            # stream) where the HTTP edge signals it (`ClientGone`); counted alike while queued
            if entry.queued:
                self._abandoned(state, req, t0)
                return "abandoned"
            return "released" if entry.dispatched else "moved"  # it had left the queue
        req.queued_s = perf_counter() - t0
        if isinstance(exc, ShutDownWhileQueued):
            req.route = "interrupted"
            return "interrupted"
        if isinstance(exc, (AuthError, PermissionDenied)):  # its key revoked meanwhile
            return "refused"  # (`_check_keys`)
        req.route = "shed"
        return "shed"

    def _abandoned(self, state: PoolState, req: ProxiedRequest, t0: float) -> None:
        """Its client left while it was queued (the caller records 499 and settles)."""
        req.queued_s = perf_counter() - t0
        self.metrics.child(self.metrics.abandoned, state.name, req.tier).inc()

    def _left(self, state: PoolState, ticket: Ticket) -> None:
        """The client disconnected while queued: out of the queue now, not at its turn."""
        if ticket.entry is not None and ticket.entry.queued:
            state.flow.remove(ticket.entry)
        ticket.fail(ClientGone())

    def _landed(self, state: PoolState, ticket: Ticket) -> None:
        if state.transit is ticket:
            state.transit = None
        self._pump(state)

