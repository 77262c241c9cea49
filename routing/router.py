"""The router: one object holding the routing core's state, asked `pick` per request.

INTERIM: round robin over healthy replicas only. The routing-core work replaces the body with
the policy registry (round_robin, least_load, consistent_hash, cache_aware); the method names
and signatures here are the contract the gateway codes against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from routing.types import Decision, ReplicaView, RequestFeatures

__all__ = ["NoCandidate", "Router", "RouterConfig"]


class NoCandidate(Exception):
    """No healthy replica among the views given to `pick`."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    policy: str = "cache_aware"
    block_chars: int = 256
    max_blocks: int = 256
    load_factor: float = 1.25


class Router:
    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self._turn = 0

    def pick(
        self, features: RequestFeatures, views: Sequence[ReplicaView], now: float
    ) -> Decision:
        healthy = [v.id for v in views if v.healthy]
        if not healthy:
            raise NoCandidate(features.model)
        start = self._turn % len(healthy)
        self._turn += 1
        order = healthy[start:] + healthy[:start]
        return Decision(replica=order[0], fallbacks=tuple(order[1:]), reason="round-robin")

    def record_route(self, replica: str, features: RequestFeatures, now: float) -> None:
        """A request was sent to `replica` (updates the affinity index)."""

    def record_first_token(
        self, replica: str, features: RequestFeatures, ttft_s: float, now: float
    ) -> None:
        """The first token arrived after `ttft_s` (learns the replica's prefill rate)."""

    def forget_replica(self, replica: str) -> None:
        """`replica` left its pool: drop everything known about it."""
