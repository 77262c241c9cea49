"""`consistent_hash`: consistent hashing with bounded loads over a ring of virtual nodes.

The key is the request's first prefix block that is *not* common, i.e. held (per the affinity
index) by fewer than half the pool: a system prompt every request shares quickly becomes
common and is skipped, so traffic spreads by what follows it (the conversation, the document)
instead of piling onto the system prompt's owner. A request walks the ring from its key and
takes the first replica the bounded-load rule admits; a hot key therefore overflows to the
same next replica on the ring every time, which then builds that prefix's cache too.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

from routing.load import LoadBound
from routing.policies.base import PickContext, RouterState, decide
from routing.types import Decision

__all__ = ["ConsistentHash", "Ring"]

_RING_CACHE = 16  # rings kept (one per distinct candidate set, i.e. per pool)


class Ring:
    """A hash ring of ``vnodes`` points per replica; `order(key)` is the successor order."""

    def __init__(self, replicas: Sequence[str], vnodes: int) -> None:
        points = sorted(
            (xxh3_64_intdigest(f"{r}#{i}".encode()), r) for r in replicas for i in range(vnodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [r for _, r in points]
        self._n = len(set(replicas))
        self._orders: dict[int, tuple[str, ...]] = {}

    def order(self, key: int) -> tuple[str, ...]:
        pos = bisect_left(self._points, key) % len(self._points)
        cached = self._orders.get(pos)
        if cached is None:
            seen: dict[str, None] = {}
            i = pos
            while len(seen) < self._n:
                seen.setdefault(self._owners[i], None)
                i = (i + 1) % len(self._owners)
            cached = self._orders[pos] = tuple(seen)
        return cached


class ConsistentHash:
    name = "consistent_hash"

    def __init__(self, state: RouterState) -> None:
        self._state = state
        self._rings: dict[tuple[str, ...], Ring] = {}

    def _ring(self, ids: tuple[str, ...]) -> Ring:
        ring = self._rings.get(ids)
        if ring is None:
            if len(self._rings) >= _RING_CACHE:
                self._rings.clear()
            ring = self._rings[ids] = Ring(ids, self._state.config.virtual_nodes)
        return ring

    def key(self, ctx: PickContext) -> int:
        index = self._state.index
        common = max(2, (len(ctx.views) + 1) // 2)
        for h in ctx.features.block_hashes:
            if index.holders(h) < common:
                return h
        return ctx.tie_key

    def choose(self, ctx: PickContext) -> Decision:
        cfg = self._state.config
        views = {v.id: v for v in ctx.views}
        order = self._ring(tuple(views)).order(self.key(ctx))
        bound = LoadBound(ctx.views, cfg.load_factor, cfg.load_slack, ctx.left_out)
        for i, rid in enumerate(order):
            if bound.admits(views[rid]):
                rest = order[:i] + order[i + 1 :]
                return decide((rid, *rest), "hash" if i == 0 else "overflow")
        # none within it: only when silent replicas left out hold less than the rest
        rid = min(order, key=lambda r: views[r].inflight)
        return decide((rid, *(r for r in order if r != rid)), "overflow")
