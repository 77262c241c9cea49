"""The pools' flow control state, and what each request holds there until it is over: the
base of `FlowGate` (`gateway/flow/gate.py`, whose docstring tells the whole). One state per
pool (`PoolState`), made when first needed and forgotten with its pool; the saturation rule's
inputs (other gateways' load and what they may have sent unseen, `peers`; a replica backing
off a busy 503 as full, `busy_full`); a request's share charged at its send and settled at its
end (`_sent`, `_done`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial

from gateway.body import ParsedBody
from gateway.config import FlowSection
from gateway.flow.cost import asked_tokens
from gateway.flow.metrics import FlowMetrics
from gateway.flow.tickets import PoolState, Ticket
from gateway.metrics import GatewayMetrics
from gateway.planner import Plan, Planner
from gateway.policy_doc import PolicyDoc
from gateway.pool import Pool, Pools
from gateway.replicas import Replica
from gateway.request import ProxiedRequest
from gateway.tenancy.resolver import Principal
from routing.flow import Entry, FlowConfig, PoolFlow, Saturation
from routing.flow.unseen import UnseenPicks
from routing.peers import ReplicaLoad
from routing.router import Router
from routing.types import Decision, ReplicaView

__all__ = ["QUEUED", "FlowLedger"]

_NO_PEERS: Mapping[str, ReplicaLoad] = {}
QUEUED = "queued"  # the route of a request that waited


class FlowLedger:
    """Per pool: its queue and bounds (`PoolFlow`), what was sent there and what it holds."""

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
        self._states: dict[str, PoolState] = {}
        self._lag = lag
        self._unseen = UnseenPicks()  # this gateway's recent picks (`peers`)
        self.metrics = FlowMetrics(metrics.registry, self._queues, self._saturation)
        metrics.pool_forgetters.append(self._forget_pool)

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

    def retry_to(self, pool: str, fallbacks: list[Replica], now: float) -> list[Replica]:
        """The ``fallbacks`` a request's retry may go to in ``pool``: those with room now. The
        slot is the client request's, taken once at its admission (no second charge, no
        second wait in the queue), but a retry is a send to a replica: one to a fallback that
        filled while the first try waited (a first-byte timeout: seconds) put the replica past
        its bound while the queue held other requests back for it. None with room: no retry,
        the request ends with its try's failure (never served: its RPM and tokens given back,
        `prepare.unserved`) and the client's own retry waits its turn in the queue."""
        state = self._states.get(pool)
        if state is None or not fallbacks:
            return fallbacks
        views = self.busy_full(pool, [r.view(now) for r in fallbacks], now)
        peers = self.peers(now)
        return [r for r, v in zip(fallbacks, views, strict=True) if state.flow.has_room(v, peers)]

    # -- state (read by gateway/flow/explain.py too) -------------------------------------------
    @property
    def core(self) -> FlowConfig:
        return self._core

    def doc(self, principal: Principal) -> PolicyDoc:
        """The policy ``principal`` was resolved under (the pools' when it carries none)."""
        return self._planner.doc(principal)

    def state(self, pool: str) -> PoolState:
        state = self._states.get(pool)
        if state is None:
            flow: PoolFlow[Ticket] = PoolFlow(self._core)
            flow.set_saturation(self._rule(pool, self._pools.doc))
            state = self._states[pool] = PoolState(pool, flow)
        return state

    def _rule(self, pool: str, doc: PolicyDoc) -> Saturation:
        """``pool``'s saturation rule: the config's, with the policy's in-flight bound for
        it (``pools.<p>.max_inflight``, changed at run time) when the policy sets one."""
        cfg = doc.pools.get(pool)
        rule = self._core.saturation
        if cfg is None or cfg.max_inflight is None or cfg.max_inflight == rule.max_inflight:
            return rule
        return replace(rule, max_inflight=cfg.max_inflight)

    def _shares(self, state: PoolState, doc: PolicyDoc) -> None:
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
        self, state: PoolState, req: ProxiedRequest, tenant: str, cost: float,
        entry: Entry[Ticket] | None = None,
    ) -> None:
        """``req`` goes to ``state``'s pool: it holds ``cost`` tokens there until it is over
        (``entry``: its place in the queue, when it waited)."""
        state.sends += 1
        state.sent_at = self._clock()
        req.flow_done = partial(self._done, state, req, tenant, cost, entry)

    def _done(
        self, state: PoolState, req: ProxiedRequest, tenant: str, cost: float,
        entry: Entry[Ticket] | None,
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

    def pools(self) -> dict[str, PoolState]:
        return self._states

    def _forget_pool(self, pool: str) -> None:
        """A pool a policy removed, once it has lingered: its series go, and its state when
        nothing is queued or in transit there (a state is made again if the pool comes back)."""
        self.metrics.forget_pool(pool)
        state = self._states.get(pool)
        if state is not None and not len(state.flow) and state.transit is None \
                and state.timer is None:
            del self._states[pool]

    def _queues(self) -> list[tuple[str, PoolFlow[Ticket]]]:
        return [(name, state.flow) for name, state in self._states.items()]

    def _saturation(self) -> list[tuple[str, bool]]:
        now = self._clock()
        return [(pool.name, self.saturated(pool, now)) for pool in self._pools.by_name.values()]

    def saturated(self, pool: Pool, now: float) -> bool:
        state = self.state(pool.name)
        views = [r.view(now) for r in pool.replicas]
        return state.flow.saturated(self.busy_full(pool.name, views, now),
                                    self.peers(now))
