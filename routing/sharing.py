"""One router's shared state: several gateways deciding as one.

After `Router.enable_sharing` every chain the router routes is also queued in `outbox` for the
caller to publish, and other gateways' records come in through `apply_routes` (into the same
affinity index) and `apply_load` (their in-flight work per replica, given to the policy at
pick time, aged out when a peer goes quiet: `routing.peers`). Within the sync window the
gateways take turns (`routing.turns`), and a contested pick may be held until the lower ranks'
picks of the same instant have arrived (`defer_s`; whether a hold pays: `routing.holds`). The
live gateway carries records over Redis (`gateway.fleet`); the offline replay delivers them
after a simulated delay. Both call the same `Router` methods, which delegate here.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter

from routing.holds import HoldOdds
from routing.peers import PeerLoads, ReplicaLoad, RouteRecord
from routing.policies import PickContext, Policy, RouterState
from routing.policies.base import PeerComputing
from routing.turns import Turns
from routing.types import ReplicaView, RequestFeatures

__all__ = ["Sharing"]

_by_id = attrgetter("id")
_NO_LOADS: Mapping[str, ReplicaLoad] = {}
_NO_COMPUTING: Mapping[str, Sequence[PeerComputing]] = {}
_COMPUTING_KEPT = 8  # a replica's latest peer routes with new blocks (`peer_computing`)
_COMPUTING_S = 5.0  # ... at most this old
_MAX_PEER_CHAINS = 65_536  # chains remembered for `_settle_continued` (oldest forgotten)
_CONTINUATION_SCAN = 64  # blocks from the end of a request searched for a peer's chain end
# a deferred pick waits rank x window x this: just past the lower ranks' records' arrival
_DEFER_MARGIN = 1.001


class Sharing:
    """A `Router`'s records out and its peers' records in; off (``peers`` None) until
    `enable`. Peers' routes applied before it are learned all the same."""

    def __init__(self, state: RouterState, policy: Policy) -> None:
        self.state = state
        # the policy reads other gateways' load beside the views (`PickContext.peer_loads`):
        # no views rebuilt with it on every pick
        self._reads_peer_loads = bool(getattr(policy, "reads_peer_loads", False))
        # the policy keeps its own record of routes (cache_aware's live contexts): peers'
        # routes are shown to it too, so that several gateways count every context
        self._peer_route_seen: Callable[[str, tuple[int, ...], float], None] | None = getattr(
            policy, "peer_routed", None)
        self.peers: PeerLoads | None = None
        self.member = ""
        self.outbox: list[RouteRecord] = []
        # last block hash of each chain peers routed -> (peer, replica, prompt tokens, its
        # predicted uncached prefill: the tokens new to the replica) (`_settle_continued`)
        self._peer_chains: OrderedDict[int, tuple[str, str, int, float]] = OrderedDict()
        # per replica, the latest live peer routes that brought it new blocks: a request
        # matching those blocks waits for that peer's prefill (`PickContext.peer_computing`)
        self.peer_computing: dict[str, deque[PeerComputing]] = {}
        self.turns = Turns(state.replica_hashes)
        # the record of a pick a peer may be holding for arrives this late (`defer_s`): the
        # caller publishes such a route at once (`Router.on_urgent`) and reads at once while
        # it holds a pick (`Router.holding`), not once per batching interval
        self._hold_window = 0.0
        self._urgent: RequestFeatures | None = None  # a pick peers may hold for (`context`)
        self.defers = False  # `enable(defer=True)`: picks may be held (`defer_s`)
        self._peer_routed_at = float("-inf")  # a live peer route was last applied then
        self._odds: HoldOdds | None = None  # whether a hold pays (`defer_s`)
        self._contested: Callable[[PickContext], int] | None = None  # the policy's

    def enable(
        self, policy: Policy, stale_after_s: float, member: str, window_s: float, defer: bool,
        hold_window_s: float | None,
    ) -> None:
        """As `Router.enable_sharing` (which documents the arguments)."""
        self.peers = PeerLoads(stale_after_s)
        self.member = member
        self.turns.window = window_s
        self._hold_window = window_s if hold_window_s is None else min(hold_window_s, window_s)
        contested = getattr(policy, "contested", None)
        self.defers = defer and window_s > 0.0 and contested is not None
        self._contested = contested
        self._odds = HoldOdds(member, window_s) if self.defers else None

    def publish(
        self, replica: str, hashes: tuple[int, ...], tail: int, features: RequestFeatures
    ) -> bool:
        """Queue our route in the outbox; whether it is one a peer may be holding a pick for
        (the caller publishes it at once: `Router.on_urgent`)."""
        # built in C: a named tuple's own __new__ is Python code, and this runs per request
        self.outbox.append(tuple.__new__(RouteRecord, (replica, hashes, tail)))
        if features is self._urgent:
            self._urgent = None
            return True
        return False

    def drain(self) -> list[RouteRecord]:
        out, self.outbox = self.outbox, []
        return out

    def apply_routes(
        self, records: Sequence[RouteRecord], member: str, now: float, live: bool
    ) -> None:
        """As `Router.apply_peer_routes`."""
        insert, tpb = self.state.index.insert, self.state.config.tokens_per_block
        chains = self._peer_chains
        seen = self._peer_route_seen if live else None
        computing = self.peer_computing
        if live and records:
            self._peer_routed_at = now
            if self._odds is not None:
                self._odds.peer_routed(member, len(records), now)
        for replica, hashes, tail in records:
            held = insert(replica, hashes, tail, True)  # (the blocks held before)
            new = len(hashes) + tail - held
            if live and hashes and new > 0:
                q = computing.get(replica)
                if q is None:
                    q = computing[replica] = deque(maxlen=_COMPUTING_KEPT)
                while q and now - q[0][0] > _COMPUTING_S:
                    q.popleft()
                q.append((now, hashes, held, float(new * tpb)))
            if len(hashes) >= 2:
                chains[hashes[-1]] = (member, replica, (len(hashes) + tail) * tpb,
                                      float(max(new, 0) * tpb))
            if seen is not None:
                seen(replica, hashes, now)
        while len(chains) > _MAX_PEER_CHAINS:
            chains.popitem(last=False)

    def _settle_continued(self, hashes: tuple[int, ...]) -> None:
        """A request that extends a chain a peer routed (a conversation's next turn) means
        that peer's request has finished -- the client had its answer -- even if the peer's
        load record saying so is still on its way: count it as finished now. Without this a
        turn sent to another gateway a millisecond after the previous one ended finds the
        previous one still in flight there, and the bounded-load rule sends it elsewhere.

        The request must extend the chain by a block at least: a chain equal to the peer's
        is the same prompt again, or another prompt on the same first ``max_blocks`` blocks
        (a question on a document longer than the hash cap: every question on it hashes to
        one chain), not the next turn. Four gateways on huge-documents settled ~900 such
        requests of the peers' a run, most still in flight on the document's holder."""
        assert self.peers is not None
        chains = self._peer_chains
        # the deepest of the request's last blocks but its own last that ends a peer's
        # chain (searched in C)
        scan = hashes[-_CONTINUATION_SCAN - 1:-1]
        end = next(filter(chains.__contains__, reversed(scan)), None)
        if end is not None:
            member, replica, tokens, work = chains.pop(end)
            self.peers.settle(member, replica, tokens, self.state.config.tokens_per_block,
                              work)

    def apply_load(self, member: str, loads: Mapping[str, ReplicaLoad], now: float) -> None:
        """As `Router.apply_peer_load`."""
        peers = self.peers
        if peers is None:
            return
        grew = peers.apply(member, loads, now)
        if grew:
            totals, pending, rate = peers.totals(now), self.state.pending, self.state.ttft.rate
            for replica, more in grew:
                sums = totals.get(replica)  # (the peers' sum there before: without `more`)
                before = sums.pending_work - more if sums is not None else 0.0
                pending.arrived(replica, more, now, rate(replica), before)

    def others_pending(self, replica: str, now: float) -> float:
        """The peers' predicted pending prefill work on ``replica`` (0 while off)."""
        if self.peers is None:
            return 0.0
        peer = self.peers.totals(now).get(replica)
        return peer.pending_work if peer is not None else 0.0

    def context(
        self, features: RequestFeatures, healthy: list[ReplicaView], now: float, explain: bool,
        held: bool, silent: Sequence[ReplicaView] = (),
    ) -> tuple[PickContext, bool]:
        """The policy's input for a pick among ``healthy`` (sorted by id; ``silent``: the
        healthy ones left out, `PickContext.left_out`), and whether other gateways' load is
        in it."""
        used_peers = False
        rank, gateways = 0, 1
        peer_loads: Mapping[str, ReplicaLoad] = _NO_LOADS
        peer_computing: Mapping[str, Sequence[PeerComputing]] = _NO_COMPUTING
        totals: Mapping[str, ReplicaLoad] = _NO_LOADS
        if self.peers is not None:
            if self._peer_chains and not explain:
                self._settle_continued(features.block_hashes)
            totals = self.peers.totals(now)
            if totals:
                if self._reads_peer_loads:
                    peer_loads = totals
                    peer_computing = self.peer_computing
                    used_peers = not totals.keys().isdisjoint(map(_by_id, healthy))
                else:
                    healthy, used_peers = _with_peers(healthy, totals)
            rank, gateways = self.turns.rank(self.peers, self.member, now)
        turn, order = 0, None
        if gateways > 1 and self.turns.window > 0:
            turn, order = self.turns.turn(healthy, peer_loads, now, rank, gateways)
            if held:  # a held pick sees the lower ranks' picks instead (`defer_s`)
                order = None
            if self.defers and not explain and rank < gateways - 1:
                # a contested pick (held, or taking a turn) is one a higher rank may be
                # holding a pick for: its route goes out at once (`publish`)
                if held:
                    self._urgent = features
                elif order is not None:
                    order = self._flagged(order, features)
        left_out = (0, 0)
        if silent:
            left_out = (sum(v.inflight + (p.inflight if (p := totals.get(v.id)) else 0)
                            for v in silent), len(silent))
        ctx = PickContext(features, healthy, now, self.state, explain, rank, gateways, turn, order,
                          peer_loads, peer_computing, left_out)
        return ctx, used_peers

    def _flagged(
        self, order: Callable[[], tuple[str, ...]], features: RequestFeatures
    ) -> Callable[[], tuple[str, ...]]:
        """``order``, marking the pick urgent when the policy asks for it: it does only
        when several candidates are about as good (a contested pick)."""

        def flagged() -> tuple[str, ...]:
            self._urgent = features
            return order()

        return flagged

    def defer_s(self, now: float, context: Callable[[], PickContext]) -> float:
        """How long the caller should hold a request before `Router.pick` (seconds; 0: pick it
        now); ``context``: the pick's `PickContext`, built only if asked for.

        Within the sync window gateways cannot see each other's picks; a pick among several
        candidates about as good (no holder of its prefix to go to: the policy's
        `contested`) is the one peers' unseen picks of the same instant stack on. In a burst
        (a pick of this gateway's, or a peer's route applied, within the last window), the
        gateway ranked r among the N live ones makes such a pick r sync windows after the
        arrival (a little more: the records of the pick of rank r - 1 arrive one window
        after it), when the lower-ranked gateways' picks of that instant have reached it,
        and routes knowing their sizes, without a turn. Rank 0 never waits, nor one
        gateway, nor a pick for its prefix's holder, nor one outside a burst (it takes its
        turn: holding every contested pick cost the synthetic workload's tail the wait
        itself), nor one whose hold is expected to cost it more than the lower ranks' unseen
        picks would (`routing.holds`: a short first token's). At most (N - 1) windows. The
        window here is the hold window (`Router.enable_sharing`): such picks' records are
        published and read at once, not batched. (docs/shared-state.md, "Deferred picks")"""
        if not self.defers:
            return 0.0
        assert self.peers is not None
        turns = self.turns
        rank, gateways = turns.rank(self.peers, self.member, now)
        if rank == 0 or gateways == 1:
            return 0.0
        if not (turns.recent_picks(now) or now - self._peer_routed_at < turns.window):
            return 0.0  # no pick of ours nor a peer's within the window: not in a burst
        contested, odds = self._contested, self._odds
        if contested is None or odds is None:
            return 0.0
        near = contested(context())
        if near < 2:
            return 0.0
        hold = rank * self._hold_window * _DEFER_MARGIN
        st = self.state
        collision = st.pending.mean_request_tokens * st.ttft.fleet.s_per_token
        if not odds.worth(now, rank, len(turns.recent), near, collision, hold):
            return 0.0
        odds.held(now)
        return hold


def _with_peers(
    views: list[ReplicaView], totals: Mapping[str, ReplicaLoad]
) -> tuple[list[ReplicaView], bool]:
    """``views`` with other gateways' load added (fleet-wide in-flight and pending work)."""
    out: list[ReplicaView] = []
    used = False
    for v in views:
        p = totals.get(v.id)
        if p is None:
            out.append(v)
            continue
        used = True
        out.append(ReplicaView(
            v.id, v.pool, v.healthy, v.waiting, v.running, v.kv_usage,
            v.cache_capacity_tokens, v.scrape_age_s, v.inflight + p.inflight,
            v.inflight_prefill_tokens + p.prefill_tokens, v.inflight_prefill + p.prefill,
            v.peer_prefill_work + p.pending_work,
        ))
    return out, used
