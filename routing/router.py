"""The router: one object holding the routing core's state, asked `pick` per request.

The gateway (and the offline replayer) call, per request: `pick` -> send -> `record_route`
(the replica it was actually sent to) -> `record_first_token` when the first token arrives
(or `record_failure` when it never will). `forget_replica` when a replica leaves its pool,
`forget_cache` when its engine restarted (its prefix cache is empty).
Nothing here reads a clock: ``now`` is passed in (seconds, any monotonic origin).

Shared state (several gateways deciding as one): after `enable_sharing`, every routed chain
is also queued in `outbox` for the caller to publish, and other gateways' records come in
through `apply_peer_routes` (into the same affinity index) and `apply_peer_load` (their
in-flight work per replica, added to the views at pick time, aged out when a peer goes
quiet). The live gateway carries records over Redis (`gateway.fleet`); the offline replay
delivers them after a simulated delay. Both call the same methods.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter

from routing.config import RouterConfig
from routing.holds import HoldOdds
from routing.index import AffinityIndex
from routing.learning import EngineCounters, PendingWork, TtftFit, TtftModel
from routing.load import replica_hash
from routing.peers import PeerLoads, ReplicaLoad, RouteRecord
from routing.policies import PickContext, PolicyFactory, RouterState, build_policy
from routing.policies.base import PeerComputing
from routing.types import Decision, ReplicaView, RequestFeatures

__all__ = ["NoCandidate", "Router", "RouterConfig"]


class NoCandidate(Exception):
    """No healthy replica among the views given to `pick`."""


_by_id = attrgetter("id")
_NO_LOADS: Mapping[str, ReplicaLoad] = {}
_NO_COMPUTING: Mapping[str, Sequence[PeerComputing]] = {}
_COMPUTING_KEPT = 8  # a replica's latest peer routes with new blocks (`peer_computing`)
_COMPUTING_S = 5.0  # ... at most this old
_MAX_PEER_CHAINS = 65_536  # chains remembered for `_settle_continued` (oldest forgotten)
_CONTINUATION_SCAN = 64  # blocks from the end of a request searched for a peer's chain end
_MIN_OBSERVATION_WEIGHT = 0.1  # a first token counts at least this much (`record_first_token`)
# a deferred pick waits rank x window x this: just past the lower ranks' records' arrival
_DEFER_MARGIN = 1.001


def _request_key(features: RequestFeatures) -> tuple[int, int]:
    last = features.block_hashes[-1] if features.block_hashes else 0
    return (features.prefix_key or last, features.prompt_tokens)


class Router:
    def __init__(
        self, config: RouterConfig | None = None, *, policy: PolicyFactory | None = None
    ) -> None:
        """``policy``: a policy outside the registry (the offline replay's yardsticks);
        by default the registry's ``config.policy``."""
        self.config = cfg = config or RouterConfig()
        self.state = RouterState(
            config=cfg,
            index=AffinityIndex(cfg.fallback_capacity_tokens // cfg.tokens_per_block),
            ttft=TtftModel(
                cfg.prior_prefill_tps, cfg.prior_fixed_s, cfg.prior_weight, cfg.rate_decay,
                cfg.min_prefill_tps, cfg.max_fixed_s, cfg.outlier_factor, cfg.fleet_weight,
            ),
            pending=PendingWork(cfg.pending_ttl_s, cfg.prior_request_tokens),
            replica_hashes={},
        )
        self.policy = policy(self.state) if policy else build_policy(cfg.policy, self.state)
        # the policy reads other gateways' load beside the views (`PickContext.peer_loads`):
        # no views rebuilt with it on every pick
        self._reads_peer_loads = bool(getattr(self.policy, "reads_peer_loads", False))
        # the policy keeps its own record of routes (cache_aware's live contexts): peers'
        # routes are shown to it too, so that several gateways count every context
        self._peer_route_seen: Callable[[str, tuple[int, ...], float], None] | None = getattr(
            self.policy, "peer_routed", None)
        # ...and where a request really went: a retry on a fallback moves its context there
        self._route_seen: Callable[[str, Sequence[int]], None] | None = getattr(
            self.policy, "routed", None)
        self._capacity_tokens: dict[str, int] = {}
        # shared state: off until `enable_sharing`
        self.peers: PeerLoads | None = None
        self.member = ""
        self.outbox: list[RouteRecord] = []
        # called when the outbox stops being empty (the publisher wakes up at once: a
        # conversation's next turn may reach another gateway a few ms after this one ends)
        self.on_outbox: Callable[[], None] | None = None
        # last block hash of each chain peers routed -> (peer, replica) (`_settle_continued`)
        self._peer_chains: OrderedDict[int, tuple[str, str]] = OrderedDict()
        # per replica, the latest live peer routes that brought it new blocks: a request
        # matching those blocks waits for that peer's prefill (`PickContext.peer_computing`)
        self.peer_computing: dict[str, deque[PeerComputing]] = {}
        self._window = 0.0  # peers' records arrive about this late (`enable_sharing`)
        # ... and the record of a pick a peer may be holding for this late (`defer_s`): the
        # caller publishes such a route at once (`on_urgent`) and reads at once while it
        # holds a pick (`holding`), not once per batching interval
        self._hold_window = 0.0
        self.on_urgent: Callable[[], None] | None = None  # such a route is in the outbox
        self.on_hold: Callable[[], None] | None = None  # a pick is held until `held_until`
        self.held_until = float("-inf")
        self._urgent: RequestFeatures | None = None  # a pick peers may hold for (`_context`)
        self._recent: deque[tuple[float, str]] = deque()  # own routes within the window
        self._recent_counts: dict[str, int] = {}  # ... per replica
        self._ranked_members: tuple[str, ...] | None = None  # `_rank` for these live peers
        self._ranked = (0, 1)
        self._defers = False  # `enable_sharing(defer=True)`: picks may be held (`defer_s`)
        self._peer_routed_at = float("-inf")  # a live peer route was last applied then
        self._odds: HoldOdds | None = None  # whether a hold pays (`defer_s`)
        self._contested: Callable[[PickContext], int] | None = None  # the policy's
        self.decisions = 0  # picks made (explain calls excluded)
        self.peer_decisions = 0  # of those, picks that used other gateways' records

    # -- shared state ---------------------------------------------------------------------------
    def enable_sharing(
        self, stale_after_s: float, member: str, window_s: float = 0.0, defer: bool = False,
        hold_window_s: float | None = None,
    ) -> None:
        """Publish routed chains to `outbox`; accept other gateways' records. ``member``:
        this gateway's id in the shared state (as its peers know it); ``window_s``: how
        late the others' records usually arrive (publish batching + transit); ``defer``: the
        caller asks `defer_s` before each pick, holds the request that long and then says
        so (`pick(held=True)`: a held pick takes no turn); ``hold_window_s``: how late the
        record of a pick peers may hold for arrives, at most ``window_s`` (the caller
        publishes such a route at once, `on_urgent`, and reads at once while it holds a
        pick, `holding`; default ``window_s``: every record equally late, as offline)."""
        self.peers = PeerLoads(stale_after_s)
        self.member = member
        self._window = window_s
        self._hold_window = window_s if hold_window_s is None else min(hold_window_s, window_s)
        contested = getattr(self.policy, "contested", None)
        self._defers = defer and window_s > 0.0 and contested is not None
        self._contested = contested
        self._odds = HoldOdds(member, window_s) if self._defers else None

    def holding(self, until: float) -> None:
        """The caller holds a pick until ``until`` (as `defer_s` asked): peers' records of
        the same instant should be read as soon as they exist, not at the next batch."""
        if until > self.held_until:
            self.held_until = until
        if self.on_hold is not None:
            self.on_hold()

    @property
    def defers(self) -> bool:
        """Whether the caller holds picks `defer_s` asks it to (`enable_sharing`)."""
        return self._defers

    def _rank(self, now: float) -> tuple[int, int]:
        """(this gateway's rank among the live gateways, how many are live)."""
        assert self.peers is not None
        members = self.peers.member_ids(now)  # the same tuple while membership holds
        if members is not self._ranked_members:
            self._ranked_members = members
            self._ranked = ((0, 1) if not members else
                            (sorted((*members, self.member)).index(self.member),
                             len(members) + 1))
        return self._ranked

    def _turn(
        self, views: Sequence[ReplicaView], peer_loads: Mapping[str, ReplicaLoad], now: float,
        rank: int, gateways: int,
    ) -> tuple[int, Callable[[], tuple[str, ...]]]:
        """This pick's turn among the picks all gateways make within the sync window, and the
        order the gateways agree on to take turns in (`PickContext.turn`; a function: the
        policy asks for it only when several candidates are about as good).

        Within the window a gateway cannot see the others' picks. Arrivals at one instant
        (a burst) split over N gateways; deciding on the same shared state, each would send its
        share to the same cheapest replicas. Requests being spread evenly over the gateways,
        while this one made ``k`` picks in the window each other one made about ``k`` too, and
        in this round those ranked before it one more: its turn is ``k x N + rank``. The order
        is the replicas by fleet-wide in-flight requests as all gateways knew them at the
        window's start (this gateway's own picks in the window taken out; ``peer_loads``: the
        others' when not in the views), then by a hash of the replica id: the same for every
        gateway."""
        recent = self._recent_picks(now)

        def order() -> tuple[str, ...]:
            own, hashes, pget = self._recent_counts, self.state.replica_hashes, peer_loads.get
            keyed = []
            for v in views:
                p = pget(v.id)
                shared = v.inflight + (p.inflight if p is not None else 0) - own.get(v.id, 0)
                keyed.append((shared, hashes[v.id], v.id))
            keyed.sort()
            return tuple(k[2] for k in keyed)

        return len(recent) * gateways + rank, order

    def _recent_picks(self, now: float) -> deque[tuple[float, str]]:
        """Our own routes within the last sync window (older ones dropped)."""
        recent, start, counts = self._recent, now - self._window, self._recent_counts
        while recent and recent[0][0] <= start:
            replica = recent.popleft()[1]
            if counts[replica] > 1:
                counts[replica] -= 1
            else:
                del counts[replica]
        return recent

    def drain_outbox(self) -> list[RouteRecord]:
        out, self.outbox = self.outbox, []
        return out

    def apply_peer_routes(
        self, records: Sequence[RouteRecord], member: str, now: float, live: bool = True
    ) -> None:
        """Gateway ``member`` routed these chains: the replicas now hold them (as if ours).
        ``live=False``: history (a catch-up, a backlog past the staleness bound), routed at
        some unknown earlier time: the index learns them, the policy's live contexts do not
        (applied in one go, every context in it would look like an agent calling now)."""
        insert, tpb = self.state.index.insert, self.config.tokens_per_block
        chains = self._peer_chains
        seen = self._peer_route_seen if live else None
        computing = self.peer_computing
        if live and records:
            self._peer_routed_at = now
            if self._odds is not None:
                self._odds.peer_routed(member, len(records), now)
        for replica, hashes, tail in records:
            held = insert(replica, hashes, tail, True)  # (the blocks held before)
            if live and hashes and (new := len(hashes) + tail - held) > 0:
                q = computing.get(replica)
                if q is None:
                    q = computing[replica] = deque(maxlen=_COMPUTING_KEPT)
                while q and now - q[0][0] > _COMPUTING_S:
                    q.popleft()
                q.append((now, hashes, held, float(new * tpb)))
            if len(hashes) >= 2:
                chains[hashes[-1]] = (member, replica)
            if seen is not None:
                seen(replica, hashes, now)
        while len(chains) > _MAX_PEER_CHAINS:
            chains.popitem(last=False)

    def _settle_continued(self, hashes: tuple[int, ...]) -> None:
        """A request that extends a chain a peer routed (a conversation's next turn) means
        that peer's request has finished -- the client had its answer -- even if the peer's
        load record saying so is still on its way: count it as finished now. Without this a
        turn sent to another gateway a millisecond after the previous one ended finds the
        previous one still in flight there, and the bounded-load rule sends it elsewhere."""
        assert self.peers is not None
        chains = self._peer_chains
        # the deepest of the request's last blocks that ends a peer's chain (searched in C)
        end = next(filter(chains.__contains__, reversed(hashes[-_CONTINUATION_SCAN:])), None)
        if end is not None:
            self.peers.settle(*chains.pop(end))

    def apply_peer_load(
        self, member: str, loads: Mapping[str, ReplicaLoad], now: float
    ) -> None:
        """Gateway ``member``'s own load changed on these replicas (it is alive at ``now``).
        Where the peers' pending work grew, they sent more there: it joins the replica's
        queue (`PendingWork.arrived`)."""
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

    def own_load(self, replica: str) -> float:
        """This router's predicted pending prefill work on ``replica`` (to publish)."""
        return self.state.pending.total(replica)

    def pick(
        self,
        features: RequestFeatures,
        views: Sequence[ReplicaView],
        now: float,
        *,
        explain: bool = False,
        held: bool = False,
    ) -> Decision:
        """Where to send ``features``; ``explain`` fills `Decision.ranked` with cost terms;
        ``held``: the caller held the request as `defer_s` asked (the pick takes no turn)."""
        ctx, used_peers = self._context(features, views, now, explain, held)
        decision = self.policy.choose(ctx)
        if not explain:
            self.decisions += 1
            if self.peers is not None and (used_peers or (
                features.block_hashes
                and self.state.index.peer_touched(decision.replica, features.block_hashes[0])
            )):
                self.peer_decisions += 1
        return decision

    def defer_s(
        self, features: RequestFeatures, views: Sequence[ReplicaView], now: float
    ) -> float:
        """How long the caller should hold this request before `pick` (seconds; 0: pick it
        now). Only a router whose caller honours it (`enable_sharing(defer=True)`) asks.

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
        window here is the hold window (`enable_sharing`): such picks' records are published
        and read at once, not batched. (docs/shared-state.md, "Deferred picks")"""
        if not self._defers:
            return 0.0
        rank, gateways = self._rank(now)
        if rank == 0 or gateways == 1:
            return 0.0
        if not (self._recent_picks(now) or now - self._peer_routed_at < self._window):
            return 0.0  # no pick of ours nor a peer's within the window: not in a burst
        contested, odds = self._contested, self._odds
        if contested is None or odds is None:
            return 0.0
        near = contested(self._context(features, views, now, False)[0])
        if near < 2:
            return 0.0
        hold = rank * self._hold_window * _DEFER_MARGIN
        st = self.state
        collision = st.pending.mean_request_tokens * st.ttft.fleet.s_per_token
        if not odds.worth(now, rank, len(self._recent), near, collision, hold):
            return 0.0
        odds.held(now)
        return hold

    def _context(
        self, features: RequestFeatures, views: Sequence[ReplicaView], now: float, explain: bool,
        held: bool = False,
    ) -> tuple[PickContext, bool]:
        """The policy's input for this pick, and whether other gateways' load is in it."""
        healthy = sorted([v for v in views if v.healthy], key=_by_id)
        if not healthy:
            raise NoCandidate(features.model)
        hashes, capacity = self.state.replica_hashes, self._capacity_tokens
        for v in healthy:
            if v.id not in hashes:
                hashes[v.id] = replica_hash(v.id)
            if v.cache_capacity_tokens and capacity.get(v.id) != v.cache_capacity_tokens:
                self._set_capacity(v.id, v.cache_capacity_tokens)
        used_peers = False
        rank, gateways = 0, 1
        peer_loads: Mapping[str, ReplicaLoad] = _NO_LOADS
        peer_computing: Mapping[str, Sequence[PeerComputing]] = _NO_COMPUTING
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
            rank, gateways = self._rank(now)
        turn, order = 0, None
        if gateways > 1 and self._window > 0:
            turn, order = self._turn(healthy, peer_loads, now, rank, gateways)
            if held:  # a held pick sees the lower ranks' picks instead (`defer_s`)
                order = None
            if self._defers and not explain and rank < gateways - 1:
                # a contested pick (held, or taking a turn) is one a higher rank may be
                # holding a pick for: its route goes out at once (`record_route`)
                if held:
                    self._urgent = features
                elif order is not None:
                    order = self._flagged(order, features)
        ctx = PickContext(features, healthy, now, self.state, explain, rank, gateways, turn, order,
                          peer_loads, peer_computing)
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

    def _set_capacity(self, replica: str, tokens: int) -> None:
        self._capacity_tokens[replica] = tokens
        self.state.index.set_capacity(replica, tokens // self.config.tokens_per_block)

    def record_route(self, replica: str, features: RequestFeatures, now: float) -> None:
        """A request was sent to `replica` (updates the affinity index and pending work)."""
        st = self.state
        prompt = features.prompt_tokens
        matched = st.index.match_one(replica, features.block_hashes) * self.config.tokens_per_block
        uncached = float(prompt - max(0, min(prompt - 1, matched)))
        others = 0.0
        if self.peers is not None:
            peer = self.peers.totals(now).get(replica)
            others = peer.pending_work if peer is not None else 0.0
        st.pending.add(replica, _request_key(features), uncached, now, others,
                       st.ttft.rate(replica))
        if features.block_hashes:
            hashes, tpb = features.block_hashes, self.config.tokens_per_block
            tail = -(-prompt // tpb) - len(hashes) if len(hashes) >= self.config.max_blocks else 0
            st.index.insert(replica, hashes, tail)
            if self._route_seen is not None:
                self._route_seen(replica, hashes)
            if self.peers is not None:
                if not self.outbox and self.on_outbox is not None:
                    self.on_outbox()
                # built in C: a named tuple's own __new__ is Python code, and this runs per request
                self.outbox.append(tuple.__new__(RouteRecord, (replica, hashes, tail)))
                if features is self._urgent:
                    self._urgent = None
                    if self.on_urgent is not None:
                        self.on_urgent()
        if self._window > 0:
            recent = self._recent
            if recent and recent[0][0] <= now - self._window:  # (`pick` pruned it already)
                self._recent_picks(now)
            recent.append((now, replica))
            self._recent_counts[replica] = self._recent_counts.get(replica, 0) + 1

    def record_first_token(
        self, replica: str, features: RequestFeatures, ttft_s: float, now: float
    ) -> None:
        """The first token arrived after `ttft_s` (learns the replica's TTFT model). The work
        predicted ahead of it is certain for its own part and a guess for the queue's, so the
        observation weighs by that share (a guessed queue attenuates the learned rate)."""
        popped = self.state.pending.pop(replica, _request_key(features))
        work, own = popped or (float(features.prompt_tokens), float(features.prompt_tokens))
        share = own / work if work > 0.0 else 1.0
        self.state.ttft.observe(replica, work, ttft_s, max(share, _MIN_OBSERVATION_WEIGHT))

    def record_counters(self, replica: str, counters: EngineCounters, now: float) -> None:
        """A scrape of ``replica``'s engine counters (learns its TTFT model from all the
        traffic it served, streamed or not, ours or not)."""
        self.state.ttft.observe_counters(replica, counters)

    def record_answered(self, replica: str, features: RequestFeatures, now: float) -> None:
        """A whole (non-streamed) answer arrived: its prefill is done, it no longer waits.
        (It carries no first-token time to learn a rate from.)"""
        self.state.pending.pop(replica, _request_key(features))

    def record_failure(self, replica: str, features: RequestFeatures, now: float) -> None:
        """The request sent to `replica` will never produce a first token (error, cancel)."""
        self.state.pending.pop(replica, _request_key(features))

    def forget_replica(self, replica: str) -> None:
        """`replica` left its pool: drop everything known about it."""
        self.state.index.forget(replica)
        self.state.ttft.forget(replica)
        self.state.pending.forget(replica)
        self.state.replica_hashes.pop(replica, None)
        self._capacity_tokens.pop(replica, None)
        if self.peers is not None:
            self.peers.forget_replica(replica)

    def forget_cache(self, replica: str) -> None:
        """``replica``'s engine restarted: its prefix cache is empty (what it learned about
        the replica's speed still holds)."""
        self.state.index.forget(replica)
        self._capacity_tokens.pop(replica, None)  # set again at the next pick

    def affinity_entries(self) -> dict[str, int]:
        """Prefix blocks remembered per replica (for ``kvgate_affinity_index_entries``)."""
        index = self.state.index
        return {r: index.entries(r) for r in index.replicas()}

    def prefill_rate(self, replica: str) -> float:
        """The learned prefill rate of ``replica`` in prompt tokens per second."""
        return self.state.ttft.rate(replica)

    def ttft_fit(self, replica: str) -> TtftFit:
        """The learned TTFT model of ``replica`` (fixed part, seconds per token)."""
        return self.state.ttft.fit(replica)


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
