"""Flow control's pump: it releases a pool's queued requests as room frees, one at a time;
sheds what waited too long or no longer fits a full queue; holds a lower band back while the
pool has had room only for less than two of the other gateways' lags (`_held_above`); and
sends a queued request elsewhere when its key, tier or the policy changed while it waited.
Part of `FlowGate` (`gateway/flow/gate.py`, whose docstring tells the whole)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import replace

from gateway.errors import AuthError, KvgateError, PermissionDenied, PoolOverloaded, QueueShed
from gateway.flow.ledger import FlowLedger
from gateway.flow.tickets import PoolState, Ticket
from gateway.policy_doc import PolicyDoc
from gateway.retry_budget import try_failed
from gateway.tenancy.models import PolicySnapshot
from gateway.tenancy.resolver import Principal
from routing.flow import RETRY_AFTER_MAX_S, Entry
from routing.peers import ReplicaLoad
from routing.types import ReplicaView

__all__ = ["FlowPump"]

_CHECK_KEYS_S = 0.5  # how often the keys of a pool's queued requests are looked up


class FlowPump(FlowLedger):
    """The release of queued requests, their shedding and moves (see the module docstring)."""

    def policy_changed(self, snap: PolicySnapshot) -> None:
        """A new policy version (`TenancyResolver.on_policy`, once the pools follow it): each
        queued request it sends to another pool than the one its own policy does, or puts in
        another band or weight, leaves its queue and is admitted again (`admit`). Left
        queued, it waited for its old pool (saturated, perhaps for long: until its
        ``max_wait_s`` shed it) while new requests went to the new one (a pool the policy
        removed: its queue went through at once, to its new pool whether saturated or not),
        or in its old band (`_reclassed`)."""
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
                if planner.pool_for(moved, ticket.model, now, ticket.need) != then or \
                        self._reclassed(entry, moved):
                    ticket.move()

    def _reclassed(self, entry: Entry[Ticket], principal: Principal) -> bool:
        """Whether the policy in force puts a queued request in another band or gives its
        tenant another weight: it is queued again (`move`, its deadline kept) in its new
        place. It kept the old one: a tier raised above another still had its waiting
        requests released after the other tier's, while its new ones went first."""
        band, weight, _ = self.doc(principal).flow_class(principal.tier, principal.tenant_id)
        return band != entry.band or weight != entry.weight

    # -- the pump ---------------------------------------------------------------------------
    def _pump(self, state: PoolState) -> None:
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
        self, state: PoolState, views: list[ReplicaView], peers: Mapping[str, ReplicaLoad],
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
        self, state: PoolState, views: list[ReplicaView], peers: Mapping[str, ReplicaLoad],
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

    def _owed_waited(self, state: PoolState, now: float, lags: float) -> bool:
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

    def _check_keys(self, state: PoolState) -> None:
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

    def _elsewhere(self, state: PoolState, entry: Entry[Ticket], principal: Principal) -> bool:
        """Whether a queued request would wait in another pool or band as ``principal``."""
        at = self._clock()
        ticket = entry.handle
        if self._planner.pool_for(principal, ticket.model, at, ticket.need) != state.name:
            return True
        return self.doc(principal).flow_class(principal.tier, principal.tenant_id)[0] != entry.band

    def _shed(self, state: PoolState, entry: Entry[Ticket], reason: str, now: float) -> None:
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

    def retry_refused(self, pool: str, tier: str, tenant: str, failure: KvgateError,
                      now: float) -> KvgateError:
        """The answer of a request whose try failed (``failure``) and whose retry no fallback
        had room for (`retry_to`): what a request of its band meets at a full queue (429, or
        503 for the top band), naming the try's failure and the in-flight bound, with the
        queue's Retry-After. It was the try's own 502 ("could not connect", a replica's 503),
        without Retry-After, while the pool it names as failing was only full."""
        state = self.state(pool)
        doc = self._pools.doc
        band = doc.flow_class(tier, tenant)[0]
        retry = state.flow.queue.retry_after(band, now)
        bound = self._rule(pool, doc).max_inflight
        said = (f"{try_failed(failure)}, and the model's other replicas are at their "
                f"in-flight bound (max_inflight {bound}); retry after {retry}s.")
        top = min((doc.flow_class(t, "")[0] for t in doc.tiers), default=band)
        if band <= top:
            return PoolOverloaded(said, retry_after=retry)
        return QueueShed(said, retry_after_s=retry)

    def _full(self, state: PoolState, band: int, doc: PolicyDoc, now: float) -> KvgateError:
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
