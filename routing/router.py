"""The router: one object holding the routing core's state, asked `pick` per request.

The gateway (and the offline replayer) call, per request: `pick` -> send -> `record_route`
(the replica it was actually sent to) -> `record_first_token` when the first token arrives
(or `record_failure` when it never will). `forget_replica` when a replica leaves its pool.
Nothing here reads a clock: ``now`` is passed in (seconds, any monotonic origin).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from routing.config import RouterConfig
from routing.index import AffinityIndex
from routing.learning import PendingWork, PrefillRates
from routing.load import replica_hash
from routing.policies import PickContext, RouterState, build_policy
from routing.types import Decision, ReplicaView, RequestFeatures

__all__ = ["NoCandidate", "Router", "RouterConfig"]


class NoCandidate(Exception):
    """No healthy replica among the views given to `pick`."""


_by_id = attrgetter("id")


def _request_key(features: RequestFeatures) -> tuple[int, int]:
    last = features.block_hashes[-1] if features.block_hashes else 0
    return (features.prefix_key or last, features.prompt_tokens)


class Router:
    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = cfg = config or RouterConfig()
        self.state = RouterState(
            config=cfg,
            index=AffinityIndex(cfg.fallback_capacity_tokens // cfg.tokens_per_block),
            rates=PrefillRates(
                cfg.prior_prefill_tps, cfg.prior_weight_s, cfg.rate_decay, cfg.min_prefill_tps
            ),
            pending=PendingWork(cfg.pending_ttl_s, cfg.prior_request_tokens),
            replica_hashes={},
        )
        self.policy = build_policy(cfg.policy, self.state)
        self._capacity_tokens: dict[str, int] = {}

    def pick(
        self,
        features: RequestFeatures,
        views: Sequence[ReplicaView],
        now: float,
        *,
        explain: bool = False,
    ) -> Decision:
        """Where to send ``features``; ``explain`` fills `Decision.ranked` with cost terms."""
        healthy = sorted([v for v in views if v.healthy], key=_by_id)
        if not healthy:
            raise NoCandidate(features.model)
        hashes, capacity = self.state.replica_hashes, self._capacity_tokens
        for v in healthy:
            if v.id not in hashes:
                hashes[v.id] = replica_hash(v.id)
            if v.cache_capacity_tokens and capacity.get(v.id) != v.cache_capacity_tokens:
                self._set_capacity(v.id, v.cache_capacity_tokens)
        ctx = PickContext(features, healthy, now, self.state, explain)
        return self.policy.choose(ctx)

    def _set_capacity(self, replica: str, tokens: int) -> None:
        self._capacity_tokens[replica] = tokens
        self.state.index.set_capacity(replica, tokens // self.config.tokens_per_block)

    def record_route(self, replica: str, features: RequestFeatures, now: float) -> None:
        """A request was sent to `replica` (updates the affinity index and pending work)."""
        st = self.state
        prompt = features.prompt_tokens
        matched = st.index.match_one(replica, features.block_hashes) * self.config.tokens_per_block
        uncached = float(prompt - max(0, min(prompt - 1, matched)))
        st.pending.add(replica, _request_key(features), uncached, now)
        if features.block_hashes:
            hashes, tpb = features.block_hashes, self.config.tokens_per_block
            tail = -(-prompt // tpb) - len(hashes) if len(hashes) >= self.config.max_blocks else 0
            st.index.insert(replica, hashes, tail)

    def record_first_token(
        self, replica: str, features: RequestFeatures, ttft_s: float, now: float
    ) -> None:
        """The first token arrived after `ttft_s` (learns the replica's prefill rate)."""
        work = self.state.pending.pop(replica, _request_key(features))
        if work is None:
            work = float(features.prompt_tokens)
        self.state.rates.observe(replica, max(work, float(self.config.tokens_per_block)), ttft_s)

    def record_failure(self, replica: str, features: RequestFeatures, now: float) -> None:
        """The request sent to `replica` will never produce a first token (error, cancel)."""
        self.state.pending.pop(replica, _request_key(features))

    def forget_replica(self, replica: str) -> None:
        """`replica` left its pool: drop everything known about it."""
        self.state.index.forget(replica)
        self.state.rates.forget(replica)
        self.state.pending.forget(replica)
        self.state.replica_hashes.pop(replica, None)
        self._capacity_tokens.pop(replica, None)

    def affinity_entries(self) -> dict[str, int]:
        """Prefix blocks remembered per replica (for ``kvgate_affinity_index_entries``)."""
        index = self.state.index
        return {r: index.entries(r) for r in index.replicas()}

    def prefill_rate(self, replica: str) -> float:
        """The learned prefill rate of ``replica`` in prompt tokens per second."""
        return self.state.rates.rate(replica)
