"""`least_load`: fewest requests in flight (kvgate's own count), then fewest prompt tokens
awaiting a first token; ties broken by a stable hash of the prompt. Ignores the cache."""

from __future__ import annotations

from routing.load import mix
from routing.policies.base import PickContext, RouterState, decide
from routing.types import Candidate, Decision

__all__ = ["LeastLoad"]


class LeastLoad:
    name = "least_load"

    def __init__(self, state: RouterState) -> None:
        self._hashes = state.replica_hashes

    def choose(self, ctx: PickContext) -> Decision:
        key = ctx.tie_key
        ranked = sorted(
            ctx.views,
            key=lambda v: (v.inflight, v.inflight_prefill_tokens, mix(key, self._hashes[v.id])),
        )
        explained: tuple[Candidate, ...] = ()
        if ctx.explain:
            explained = tuple(
                Candidate(
                    v.id,
                    float(v.inflight),
                    {"inflight": float(v.inflight), "prefill_tokens": v.inflight_prefill_tokens},
                )
                for v in ranked
            )
        return decide([v.id for v in ranked], "least-load", explained)
