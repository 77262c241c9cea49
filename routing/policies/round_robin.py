"""`round_robin`: healthy replicas in id order, one after the other. Ignores load and cache."""

from __future__ import annotations

from routing.policies.base import PickContext, RouterState, decide
from routing.types import Decision

__all__ = ["RoundRobin"]


class RoundRobin:
    name = "round_robin"

    def __init__(self, state: RouterState) -> None:
        self._turn = 0

    def choose(self, ctx: PickContext) -> Decision:
        ids = [v.id for v in ctx.views]
        start = self._turn % len(ids)
        self._turn += 1
        return decide(ids[start:] + ids[:start], "round-robin")
