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
delivers them after a simulated delay. Both call the same methods. The state and rules
behind them are `routing.sharing`'s (ranks and turns within the sync window:
`routing.turns`); the router keeps the hooks its caller sets (`on_outbox`, `on_urgent`,
`on_hold`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter

from routing.config import RouterConfig
from routing.index import AffinityIndex
from routing.learning import EngineCounters, PendingWork, TtftFit, TtftModel
from routing.load import replica_hash
from routing.peers import PeerLoads, ReplicaLoad, RouteRecord
from routing.policies import PickContext, PolicyFactory, RouterState, build_policy
from routing.sharing import Sharing
from routing.types import Decision, ReplicaView, RequestFeatures

__all__ = ["NoCandidate", "Router", "RouterConfig"]


class NoCandidate(Exception):
    """No healthy replica among the views given to `pick`."""


_by_id = attrgetter("id")
_silent_s = attrgetter("silent_s")
_MIN_OBSERVATION_WEIGHT = 0.1  # a first token counts at least this much (`record_first_token`)


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
                cfg.cold_observations,
            ),
            pending=PendingWork(cfg.pending_ttl_s, cfg.prior_request_tokens),
            replica_hashes={},
        )
        self.policy = policy(self.state) if policy else build_policy(cfg.policy, self.state)
        # the policy's record of where a request really went (cache_aware's live contexts):
        # a retry on a fallback moves its context there
        self._route_seen: Callable[[str, Sequence[int]], None] | None = getattr(
            self.policy, "routed", None)
        self._capacity_tokens: dict[str, int] = {}
        self.sharing = Sharing(self.state, self.policy)  # off until `enable_sharing`
        # called when the outbox stops being empty, or a request without a chain was routed
        # (the publisher wakes up at once: a conversation's next turn may reach another
        # gateway a few ms after this one ends; a short prompt's load is news for peers too)
        self.on_outbox: Callable[[], None] | None = None
        # a route a peer may be holding a pick for is in the outbox (`defer_s`): the caller
        # publishes it at once, and reads at once while it holds a pick (`on_hold`, until
        # `held_until`), not once per batching interval
        self.on_urgent: Callable[[], None] | None = None
        self.on_hold: Callable[[], None] | None = None
        self.held_until = float("-inf")
        self.decisions = 0  # picks made (explain calls excluded)
        self.peer_decisions = 0  # of those, picks that used other gateways' records

    # -- shared state (`routing.sharing`) -------------------------------------------------------
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
        self.sharing.enable(self.policy, stale_after_s, member, window_s, defer, hold_window_s)

    @property
    def peers(self) -> PeerLoads | None:
        """Other gateways' loads (None until `enable_sharing`)."""
        return self.sharing.peers

    @property
    def member(self) -> str:
        """This gateway's id in the shared state (`enable_sharing`)."""
        return self.sharing.member

    @property
    def outbox(self) -> list[RouteRecord]:
        """Our routes not yet drained (`drain_outbox`)."""
        return self.sharing.outbox

    @property
    def defers(self) -> bool:
        """Whether the caller holds picks `defer_s` asks it to (`enable_sharing`)."""
        return self.sharing.defers

    def holding(self, until: float) -> None:
        """The caller holds a pick until ``until`` (as `defer_s` asked): peers' records of
        the same instant should be read as soon as they exist, not at the next batch."""
        if until > self.held_until:
            self.held_until = until
        if self.on_hold is not None:
            self.on_hold()

    def drain_outbox(self) -> list[RouteRecord]:
        return self.sharing.drain()

    def apply_peer_routes(
        self, records: Sequence[RouteRecord], member: str, now: float, live: bool = True
    ) -> None:
        """Gateway ``member`` routed these chains: the replicas now hold them (as if ours).
        ``live=False``: history (a catch-up, a backlog past the staleness bound), routed at
        some unknown earlier time: the index learns them, the policy's live contexts do not
        (applied in one go, every context in it would look like an agent calling now)."""
        self.sharing.apply_routes(records, member, now, live)

    def apply_peer_load(
        self, member: str, loads: Mapping[str, ReplicaLoad], now: float
    ) -> None:
        """Gateway ``member``'s own load changed on these replicas (it is alive at ``now``).
        Where the peers' pending work grew, they sent more there: it joins the replica's
        queue (`PendingWork.arrived`)."""
        self.sharing.apply_load(member, loads, now)

    def own_load(self, replica: str) -> float:
        """This router's predicted pending prefill work on ``replica`` (to publish)."""
        return self.state.pending.total(replica)

    def defer_s(
        self, features: RequestFeatures, views: Sequence[ReplicaView], now: float
    ) -> float:
        """How long the caller should hold this request before `pick` (seconds; 0: pick it
        now). Only a router whose caller honours it (`enable_sharing(defer=True)`) asks.
        When and why: `Sharing.defer_s`."""
        return self.sharing.defer_s(now, lambda: self._context(features, views, now, False)[0])

    # -- routing ----------------------------------------------------------------------------------
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
            if self.sharing.peers is not None and (used_peers or (
                features.block_hashes
                and self.state.index.peer_touched(decision.replica, features.block_hashes[0])
            )):
                self.peer_decisions += 1
        return decision

    def _context(
        self, features: RequestFeatures, views: Sequence[ReplicaView], now: float, explain: bool,
        held: bool = False,
    ) -> tuple[PickContext, bool]:
        """The policy's input for this pick, and whether other gateways' load is in it."""
        healthy = sorted([v for v in views if v.healthy], key=_by_id)
        if not healthy:
            raise NoCandidate(features.model)
        need = features.context_tokens
        for v in healthy:  # (a loop, not any() over a generator: this runs on every pick)
            if v.max_model_len is not None and v.max_model_len < need:
                # replicas of one pool may differ in context (a rolling change of
                # --max-model-len): a request one cannot take goes to one that can, if any
                fit = [v for v in healthy if v.max_model_len is None or v.max_model_len >= need]
                healthy = fit or healthy
                break
        silent: list[ReplicaView] = []
        if self.config.silent_min_s and any(map(_silent_s, healthy)):
            healthy, silent = self._heard(healthy)
        hashes, capacity = self.state.replica_hashes, self._capacity_tokens
        for v in healthy:
            if v.id not in hashes:
                hashes[v.id] = replica_hash(v.id)
            if v.cache_capacity_tokens and capacity.get(v.id) != v.cache_capacity_tokens:
                self._set_capacity(v.id, v.cache_capacity_tokens)
        return self.sharing.context(features, healthy, now, explain, held, silent)

    def _heard(
        self, views: list[ReplicaView]
    ) -> tuple[list[ReplicaView], list[ReplicaView]]:
        """`views` split into the heard and the silent ones (`RouterConfig.silent_min_s`);
        all heard when all are silent. A replica whose requests wait far past its predicted
        TTFT with nothing heard from it is no candidate while another is (the cost model's
        queue drains with time alone)."""
        cfg, fit = self.config, self.state.ttft.fits().get
        fleet = self.state.ttft.fleet
        heard: list[ReplicaView] = []
        silent: list[ReplicaView] = []
        for v in views:
            quiet_s = max(cfg.silent_min_s, cfg.silent_factor * fit(v.id, fleet).predict(
                v.inflight_prefill_tokens / (v.inflight_prefill or 1)))
            (heard if v.silent_s <= quiet_s else silent).append(v)
        return (heard, silent) if heard else (views, [])

    def _set_capacity(self, replica: str, tokens: int) -> None:
        self._capacity_tokens[replica] = tokens
        self.state.index.set_capacity(replica, tokens // self.config.tokens_per_block)

    def record_route(self, replica: str, features: RequestFeatures, now: float) -> None:
        """A request was sent to `replica` (updates the affinity index and pending work)."""
        st, sharing = self.state, self.sharing
        prompt = features.prompt_tokens
        matched = st.index.match_one(replica, features.block_hashes) * self.config.tokens_per_block
        uncached = float(prompt - max(0, min(prompt - 1, matched)))
        others = sharing.others_pending(replica, now)
        st.pending.add(replica, _request_key(features), uncached, now, others,
                       st.ttft.rate(replica))
        if features.block_hashes:
            hashes, tpb = features.block_hashes, self.config.tokens_per_block
            tail = -(-prompt // tpb) - len(hashes) if len(hashes) >= self.config.max_blocks else 0
            st.index.insert(replica, hashes, tail)
            if self._route_seen is not None:
                self._route_seen(replica, hashes)
            if sharing.peers is not None:
                if not sharing.outbox and self.on_outbox is not None:
                    self.on_outbox()
                if sharing.publish(replica, hashes, tail, features) and self.on_urgent is not None:
                    self.on_urgent()
        elif sharing.peers is not None and self.on_outbox is not None:
            # no chain to publish (a prompt shorter than a block), but our load changed:
            # peers learn it with the next batch, not the next heartbeat (their flow control
            # and bounded load count it)
            self.on_outbox()
        sharing.turns.routed(replica, now)

    # -- learning ---------------------------------------------------------------------------------
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
        if self.sharing.peers is not None:
            self.sharing.peers.forget_replica(replica)

    def forget_cache(self, replica: str) -> None:
        """``replica``'s engine restarted: its prefix cache is empty (what it learned about
        the replica's speed still holds)."""
        self.state.index.forget(replica)
        self._capacity_tokens.pop(replica, None)  # set again at the next pick

    # -- introspection ----------------------------------------------------------------------------
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
