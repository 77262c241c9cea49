"""`sglang_style` (a yardstick, not offered for serving): SGLang's cache-aware rule as documented.

Re-implemented from SGLang/SMG's documentation and CLI defaults on kvgate's own index, so that
kvgate's routing can be compared with it on the same engine model:

1. the fleet is *imbalanced* when ``max - min > 64`` and ``max > 1.5 x min`` in-flight requests
   (the gateway's own counts): the request goes to the least-loaded replica;
2. otherwise, when the longest prefix match covers more than half the request
   (``cache_threshold`` 0.5), the replica holding it;
3. otherwise the replica with the smallest cache (SGLang's smallest radix tree: here the
   blocks kvgate's affinity index holds for it).

Ties are broken by kvgate's stable per-request hash (SGLang takes the first in order, which
piles every tie onto one worker; that would measure a bug, not the rule).
"""

from __future__ import annotations

from routing.load import mix
from routing.policies.base import PickContext, RouterState, decide
from routing.types import Decision, ReplicaView

__all__ = ["SGLangStyle"]

BALANCE_ABS = 64
BALANCE_REL = 1.5
CACHE_THRESHOLD = 0.5


class SGLangStyle:
    name = "sglang_style"

    def __init__(self, state: RouterState) -> None:
        self._state = state

    def choose(self, ctx: PickContext) -> Decision:
        st, key, views = self._state, ctx.tie_key, ctx.views
        hashes = st.replica_hashes
        loads = [v.inflight for v in views]
        if max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads):
            order = sorted(views, key=lambda v: (v.inflight, mix(key, hashes[v.id])))
            return decide([v.id for v in order], "imbalanced")
        blocks = ctx.features.block_hashes
        matched = st.index.match(blocks) if blocks else {}
        best = max(matched.values(), default=0)
        if blocks and best / len(blocks) > CACHE_THRESHOLD:

            def by_match(v: ReplicaView) -> tuple[int, int, int]:
                return (-matched.get(v.id, 0), v.inflight, mix(key, hashes[v.id]))

            order = sorted(views, key=by_match)
            return decide([v.id for v in order], "prefix-hit")
        used = st.index.used
        order = sorted(views, key=lambda v: (used(v.id), mix(key, hashes[v.id])))
        return decide([v.id for v in order], "smallest-cache")
