"""`llmd_style` (a yardstick, not offered for serving): llm-d's default scheduling profile.

Re-implemented from llm-d's documented defaults on kvgate's own index: three scorers, each in
[0, 1] and higher is better, summed with weights, the highest total wins (max-score picker):

- prefix-cache scorer, weight 3: matched blocks / request blocks (the approximate index,
  which assumes the chosen replica now holds the request's prefix, as kvgate's does);
- queue scorer, weight 2: scraped waiting requests, min-max normalised (all equal: 1);
- KV-cache utilisation scorer, weight 2: 1 - scraped KV usage.

Scraped values older than the routing core's staleness bound count as 0 waiting / 0 usage
(llm-d fails open too). Ties go to kvgate's stable per-request hash (llm-d's fix for piling
a burst onto one pod, llm-d-router #2515).
"""

from __future__ import annotations

from routing.load import fresh, mix
from routing.policies.base import PickContext, RouterState, decide
from routing.types import Candidate, Decision

__all__ = ["LlmdStyle"]

PREFIX_WEIGHT, QUEUE_WEIGHT, KV_WEIGHT = 3.0, 2.0, 2.0


class LlmdStyle:
    name = "llmd_style"

    def __init__(self, state: RouterState) -> None:
        self._state = state

    def choose(self, ctx: PickContext) -> Decision:
        st, key = self._state, ctx.tie_key
        stale, hashes = st.config.stale_after_s, st.replica_hashes
        blocks = ctx.features.block_hashes
        matched = st.index.match(blocks) if blocks else {}
        waiting = {v.id: (v.waiting or 0.0) if fresh(v, stale) else 0.0 for v in ctx.views}
        low, high = min(waiting.values()), max(waiting.values())
        scored = []
        for v in ctx.views:
            prefix = min(1.0, matched.get(v.id, 0) / len(blocks)) if blocks else 0.0
            queue = 1.0 if high == low else (high - waiting[v.id]) / (high - low)
            kv = 1.0 - ((v.kv_usage or 0.0) if fresh(v, stale) else 0.0)
            total = PREFIX_WEIGHT * prefix + QUEUE_WEIGHT * queue + KV_WEIGHT * kv
            scored.append((-total, mix(key, hashes[v.id]), v.id, prefix, queue, kv))
        scored.sort()
        ranked: tuple[Candidate, ...] = ()
        if ctx.explain:
            ranked = tuple(
                Candidate(rid, -neg, {"prefix": p, "queue": q, "kv": k})
                for neg, _, rid, p, q, k in scored
            )
        return decide([s[2] for s in scored], "max-score", ranked)
