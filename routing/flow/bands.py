"""The parts of one pool's admission queue (`queue.py`): a queued request (`Entry`), one
tenant's requests in one band (`TenantFlow`, with its start-time fair queueing tags) and one
band (`Band`: its tenants, their heads in tag order, its virtual time and minimum-share
credit). The rules that order them are `FlowQueue`'s; the module docstring of `queue.py`
states them. Pure: no asyncio, no clock.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Collection
from typing import Generic, TypeVar

__all__ = [
    "DISPATCHED", "IDLE_FLOWS", "QUEUED", "REBASE_AT", "REMOVED", "Band", "Entry", "TenantFlow",
]

T = TypeVar("T")
IDLE_FLOWS = 256  # per band: idle tenants remembered ahead of V (beyond: the oldest forgotten)
# a band's virtual time past this: every tag is shifted back by it (`Band.rebase`). Tags keep
# a precision of 2^-28 up to it, beyond the smallest advance (1 token at weight 1,000,000)
REBASE_AT = float(1 << 24)
QUEUED, DISPATCHED, REMOVED = 0, 1, 2  # an entry's state


class Entry(Generic[T]):
    """One queued request. ``handle`` is the caller's (a future, a replay request, ...)."""

    __slots__ = ("band", "cost", "deadline", "delta", "enqueued_at", "finish", "handle", "held",
                 "seq", "shift", "start", "state", "tenant", "tier", "weight")

    def __init__(
        self, handle: T, tenant: str, tier: str, band: int, cost: float, weight: float,
        enqueued_at: float, deadline: float, seq: int,
    ) -> None:
        self.handle = handle
        self.tenant, self.tier, self.band = tenant, tier, band
        self.cost = cost  # tokens: prompt + expected output
        self.weight = weight  # the tenant's
        self.delta = cost / weight  # its advance in virtual time
        self.enqueued_at, self.deadline, self.seq = enqueued_at, deadline, seq
        self.start = self.finish = 0.0
        self.shift = 0.0  # its band's `Band.shift` when its tags were last set
        self.state = QUEUED
        self.held = False  # passed over at a release for lack of spare room (`PoolFlow`)

    @property
    def queued(self) -> bool:
        return self.state == QUEUED

    @property
    def dispatched(self) -> bool:
        """Handed out by `FlowQueue.pop` (not removed, shed or still queued)."""
        return self.state == DISPATCHED

    def __repr__(self) -> str:
        return f"Entry({self.tenant!r}, band={self.band}, cost={self.cost:g}, seq={self.seq})"


class TenantFlow(Generic[T]):
    """One tenant's requests in one band."""

    __slots__ = ("backlog", "finish", "items", "tenant", "weight")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.weight = 1.0  # of its latest request
        self.items: deque[Entry[T]] = deque()
        self.finish = 0.0  # finish tag of its last request (queued or dispatched)
        self.backlog = 0.0  # sum of its queued requests' deltas


class Band(Generic[T]):
    __slots__ = ("cost", "count", "credit", "flows", "heads", "level", "shift", "vtime")

    def __init__(self, level: int) -> None:
        self.level = level
        self.vtime = 0.0
        self.shift = 0.0  # how far every tag was shifted back so far (`rebase`)
        self.flows: dict[str, TenantFlow[T]] = {}
        # (head start tag, head seq, flow): lazily invalidated (valid while it is the head)
        self.heads: list[tuple[float, int, TenantFlow[T]]] = []
        self.count = 0
        self.cost = 0.0
        self.credit = 0.0

    def rebase(self) -> None:
        """Shift the virtual time and every tag back by the virtual time: their order is
        kept, and their precision (V grows by every token dispatched over the weights; at
        1e16 an advance below 1 no longer moved a finish tag, and a late tenant waited
        behind another's whole backlog). A dispatched request's tags are read against
        `shift` (`finish_now`)."""
        v = self.vtime
        self.vtime = 0.0
        self.shift += v
        shift = self.shift
        for flow in self.flows.values():
            flow.finish -= v
            for e in flow.items:
                e.start -= v
                e.finish -= v
                e.shift = shift
        self.heads = [(f.items[0].start, f.items[0].seq, f) for f in self.flows.values()
                      if f.items]
        heapq.heapify(self.heads)

    def finish_now(self, entry: Entry[T]) -> float:
        """``entry``'s finish tag on the band's current base (rebased since it was set)."""
        return entry.finish - (self.shift - entry.shift)

    def head(self) -> Entry[T] | None:
        heads = self.heads
        while heads:
            start, seq, flow = heads[0]
            if flow.items and flow.items[0].seq == seq and flow.items[0].start == start:
                return flow.items[0]
            heapq.heappop(heads)
        return None

    def head_except(
        self, skip: Collection[str], hold: Callable[[Entry[T]], bool] | None = None
    ) -> Entry[T] | None:
        """The next request among the tenants not in ``skip`` (smallest start tag, then
        arrival), leaving out the heads ``hold`` says must wait: a scan over the backlogged
        tenants, a handful."""
        best: Entry[T] | None = None
        for flow in self.flows.values():
            if flow.items and flow.tenant not in skip:
                e = flow.items[0]
                if (best is None or (e.start, e.seq) < (best.start, best.seq)) and (
                        hold is None or not hold(e)):
                    best = e
        return best

    def biggest_backlog(self) -> TenantFlow[T]:
        """The tenant with the biggest weighted backlog; on a tie, the one whose newest
        request is newest (the band must have requests)."""
        return max((f for f in self.flows.values() if f.items), key=_backlog)

    def prune(self) -> None:
        """Forget idle tenants whose finish tag V has passed (they would start at V anyway)."""
        flows = self.flows
        if len(flows) <= self.count + 8:
            return
        v = self.vtime
        idle = [f for f in flows.values() if not f.items]
        for f in idle:
            if f.finish <= v:
                del flows[f.tenant]
        idle = [f for f in flows.values() if not f.items]
        if len(idle) > IDLE_FLOWS:
            idle.sort(key=_finish)
            for f in idle[: len(idle) - IDLE_FLOWS]:
                del flows[f.tenant]


def _backlog(flow: TenantFlow[T]) -> tuple[float, int]:
    return flow.backlog, flow.items[-1].seq


def _finish(flow: TenantFlow[T]) -> float:
    return flow.finish
