"""One pool's admission queue: priority bands, weighted fair sharing inside a band, a minimum
share per band, bounds. Pure: no asyncio, no clock; every call that needs the time gets it.

**Bands.** Every queued request belongs to a band (a small integer, lower = dispatched first:
the tier's band). The highest-priority band with requests is served, except that a lower band
is never starved: each band has a minimum share ``s`` of the dispatched tokens while a
higher band competes with it. A contended band earns ``s x cost`` credit for every dispatch
(its own included) and pays ``cost`` for its own; it is *owed* once its credit covers its next
request or `OWED_CAP` tokens, whichever is less (a larger request then leaves the band in debt),
and the highest-priority owed band goes first. Over any stretch in which a band stays
backlogged below a busier one it gets at least ``s`` of the tokens, minus one request's worth.
Credit is reset when the band is the top band with requests (nothing to make up for, nor to
owe) and a positive one when the band empties, so an idle band banks nothing; a debt stays
until worked off. A dispatched request refused before any output (`refund`) takes back the
credit its unrun tokens paid and earned.

**Inside a band:** start-time fair queueing over tenants, in tokens. A request of ``cost``
tokens from a tenant of weight ``w`` gets a start tag ``S = max(V, F)`` (``F``: the tenant's
previous finish tag, ``V``: the band's virtual time, the start tag of the last dispatched
request) and a finish tag ``S + cost / w``; the smallest start tag goes first (ties: arrival
order). A backlogged tenant therefore gets ``w / sum(w)`` of the band's tokens, and a tenant
that was idle starts at ``V``: it banks no credit for the time it sent nothing. ``V`` grows
with every token dispatched over the weights; past `REBASE_AT` every tag of the band is shifted
back by it (`Band.rebase`), so tags keep their precision over any uptime.

**Bounds.** At most ``max_queue`` requests. A request arriving at a full queue displaces the
newest request of the lowest band below its own; failing that, the newest request of the
tenant of its own band with the largest weighted backlog, when that backlog exceeds its own
tenant's (with the new request); failing that it is rejected. Each request carries its
deadline (its tier's longest wait); `expire` hands back the ones past it. Memory: the queued
requests, plus per band the tenants seen recently (idle ones are forgotten as soon as ``V``
passes their finish tag, and at most `IDLE_FLOWS` are kept beyond that).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from routing.flow.bands import DISPATCHED, QUEUED, REBASE_AT, REMOVED, Band, Entry, TenantFlow
from routing.flow.config import DEFAULT_MIN_SHARE
from routing.flow.pace import DispatchPace

__all__ = ["OWED_CAP", "RETRY_AFTER_MAX_S", "RETRY_AFTER_MIN_S", "FlowQueue", "Offer"]

T = TypeVar("T")
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60  # a shed request's Retry-After, in seconds
# the most credit a lower band needs to be owed its turn (tokens): a larger request goes once
# this is earned, and the band works off the rest as a debt. Owed only once its credit
# covered the whole request, a 100,000-token prompt at a floor of 0.1 waited for a million
# tokens of the band above: past its longest wait, shed, and its retry began from nothing.
# One saturation prefill bound's worth (`FlowConfig.max_prefill_tokens`' default).
OWED_CAP = 16_384


@dataclass(slots=True)
class Offer(Generic[T]):
    """What `FlowQueue.offer` did: queued ``entry`` (None: rejected, the queue is full and it
    could displace nobody), after shedding ``evicted`` to make room."""

    entry: Entry[T] | None
    evicted: list[Entry[T]] = field(default_factory=list)


class FlowQueue(Generic[T]):
    def __init__(
        self, max_queue: int, min_share: Mapping[int, float] | None = None,
        default_min_share: float = DEFAULT_MIN_SHARE, rate_window_s: float = 10.0,
    ) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self._bands: dict[int, Band[T]] = {}
        self._levels: list[int] = []  # sorted band levels that exist
        self._shares: dict[int, float] = {}
        self._default_share = 0.0
        self.set_shares(min_share or {}, default_min_share)
        self._deadlines: list[tuple[float, int, Entry[T]]] = []
        self._seq = 0
        self._len = 0
        self._pace = DispatchPace(rate_window_s)

    # -- configuration ------------------------------------------------------------------------
    def set_shares(self, min_share: Mapping[int, float], default: float) -> None:
        """Per band minimum shares (a band not listed: ``default``); each in [0, 1)."""
        for level, share in (*min_share.items(), (None, default)):
            if not 0.0 <= share < 1.0:
                raise ValueError(f"min_share of band {level}: must be in [0, 1)")
        self._shares = dict(min_share)
        self._default_share = default

    def share(self, level: int) -> float:
        return self._shares.get(level, self._default_share)

    # -- size ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def depth(self) -> dict[int, int]:
        """Band -> requests queued, for every band that ever had one."""
        return {lv: self._bands[lv].count for lv in self._levels}

    def flows(self) -> int:
        """Tenant states held, queued or idle (for the memory bound)."""
        return sum(len(b.flows) for b in self._bands.values())

    def backlogged(self, band: int) -> dict[str, float]:
        """The tenants with requests queued in ``band`` -> their weight (fair-share view)."""
        b = self._bands.get(band)
        if b is None:
            return {}
        return {t: f.weight for t, f in b.flows.items() if f.items}

    def waiting(self) -> dict[str, float]:
        """Every tenant with requests queued, in any band -> its weight."""
        return {t: f.weight for b in self._bands.values() if b.count
                for t, f in b.flows.items() if f.items}

    def oldest(self, now: float) -> float:
        """When the longest-waiting queued request arrived (``now`` when none waits)."""
        return min((e.enqueued_at for e in self.entries()), default=now)

    def entries(self) -> Iterator[Entry[T]]:
        for lv in self._levels:
            for flow in self._bands[lv].flows.values():
                yield from flow.items

    # -- offer --------------------------------------------------------------------------------
    def offer(
        self, handle: T, *, tenant: str, band: int, cost: float, now: float,
        max_wait_s: float, weight: float = 1.0, tier: str = "",
    ) -> Offer[T]:
        """Queue a request (see the module docstring for a full queue)."""
        if weight <= 0 or not math.isfinite(weight):
            raise ValueError("weight must be a positive number")
        cost = max(0.0, float(cost))
        evicted: list[Entry[T]] = []
        if self._len >= self.max_queue:
            victim = self._victim(tenant, band, cost / weight)
            if victim is None:
                return Offer(None)
            self._remove(victim)
            evicted.append(victim)
        self._seq += 1
        entry = Entry(handle, tenant, tier, band, cost, weight, now, now + max_wait_s, self._seq)
        b = self._band(band)
        flow = b.flows.get(tenant)
        if flow is None:
            flow = b.flows[tenant] = TenantFlow(tenant)
        flow.weight = weight
        entry.start = flow.finish if flow.items else max(b.vtime, flow.finish)
        entry.finish = flow.finish = entry.start + entry.delta
        entry.shift = b.shift
        flow.items.append(entry)
        flow.backlog += entry.delta
        if len(flow.items) == 1:
            heapq.heappush(b.heads, (entry.start, entry.seq, flow))
        b.count += 1
        b.cost += cost
        self._len += 1
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, entry))
        return Offer(entry, evicted)

    def _victim(self, tenant: str, band: int, delta: float) -> Entry[T] | None:
        for lv in reversed(self._levels):
            b = self._bands[lv]
            if not b.count:
                continue
            if lv > band:  # a lower band: its newest request from its biggest backlog
                flow = b.biggest_backlog()
                return flow.items[-1]
            if lv < band:
                return None
            own = b.flows.get(tenant)
            mine = (own.backlog if own is not None else 0.0) + delta
            flow = b.biggest_backlog()
            if flow.tenant != tenant and flow.backlog > mine:
                return flow.items[-1]
            return None
        return None

    # -- dispatch -----------------------------------------------------------------------------
    def pop(
        self, now: float, skip: Collection[str] = (),
        hold: Callable[[Entry[T]], bool] | None = None, upto: int | None = None,
    ) -> Entry[T] | None:
        """Dispatch the next request: band, then tenant (module docstring). Inside the band
        whose turn it is the tenants in ``skip`` are passed over by the others; when only
        they wait in it, the first of their heads that ``hold`` does not hold goes (any, without
        ``hold``); when it holds them all, the band's turn passes to the next band. Bands
        below ``upto`` (levels above it) wait: the turn passes over them, their credit kept."""
        entry = self._choose(skip, hold, upto)
        if entry is None:
            return None
        b = self._bands[entry.band]
        self._charge(b, entry.cost)
        b.vtime = max(b.vtime, entry.start)
        flow = b.flows[entry.tenant]
        flow.items.popleft()
        flow.backlog -= entry.delta
        if flow.items:  # the popped head's heap item is stale now (`Band.head` drops it)
            nxt = flow.items[0]
            heapq.heappush(b.heads, (nxt.start, nxt.seq, flow))
        if b.vtime >= REBASE_AT:
            b.rebase()
        self._unqueue(b, entry, DISPATCHED)
        b.prune()
        self.note_dispatch(entry.cost, now)
        return entry

    def _choose(
        self, skip: Collection[str], hold: Callable[[Entry[T]], bool] | None, upto: int | None,
    ) -> Entry[T] | None:
        for b in self._turns():
            if upto is not None and b.level > upto:
                continue
            if not skip:
                return b.head()
            entry = b.head_except(skip)
            if entry is None:  # only skipped tenants wait in it: the first one not held
                entry = b.head() if hold is None else b.head_except((), hold)
            if entry is not None:
                return entry
        return None

    def owed(self) -> int | None:
        """The level of the band below the top one owed its minimum share now (its credit
        covers its next request: it goes before the top band), None when there is none."""
        turns = self._turns()  # (by priority, unless an owed band comes first)
        return turns[0].level if len(turns) > 1 and turns[0].level > turns[1].level else None

    def _turns(self) -> list[Band[T]]:
        """The bands with requests in the order they get the turn: the highest-priority band
        owed its minimum share, then the top band, then the others by priority."""
        bands = [self._bands[lv] for lv in self._levels if self._bands[lv].count]
        for i, b in enumerate(bands[1:], 1):
            head = b.head()
            if head is not None and self.share(b.level) > 0 and b.credit >= min(head.cost,
                                                                                  OWED_CAP):
                return [b, *bands[:i], *bands[i + 1:]]  # a lower band owed its minimum share
        return bands

    def _charge(self, served: Band[T], cost: float) -> None:
        """Credits after dispatching ``cost`` tokens from ``served`` (module docstring); a
        negative ``cost`` takes back tokens that never ran (`refund`)."""
        top = True
        for lv in self._levels:
            b = self._bands[lv]
            if not b.count:
                continue
            if top:
                top = False
                if cost >= 0:
                    b.credit = 0.0  # uncontended: nothing to make up for (nor to owe)
                continue
            b.credit += self.share(lv) * cost
            if b is served:
                b.credit -= cost

    def remove(self, entry: Entry[T]) -> bool:
        """Take a queued request out (its client left); False when it is no longer queued."""
        if entry.state != QUEUED:
            return False
        self._remove(entry)
        return True

    def _remove(self, entry: Entry[T]) -> None:
        b = self._bands[entry.band]
        flow = b.flows[entry.tenant]
        items = flow.items
        was_head = items[0] is entry
        i = items.index(entry)
        del items[i]
        # the tenant's later requests move up into the removed one's place
        for later in list(items)[i:]:
            later.start -= entry.delta
            later.finish -= entry.delta
        flow.finish -= entry.delta
        flow.backlog -= entry.delta
        if was_head and items:
            heapq.heappush(b.heads, (items[0].start, items[0].seq, flow))
        self._unqueue(b, entry, REMOVED)
        b.prune()

    def _unqueue(self, b: Band[T], entry: Entry[T], state: int) -> None:
        entry.state = state
        b.count -= 1
        b.cost -= entry.cost
        self._len -= 1
        if not b.count:
            b.credit = min(b.credit, 0.0)  # an idle band banks nothing, and keeps its debt
            b.cost = 0.0
            b.heads.clear()
        dl = self._deadlines
        if not self._len:
            dl.clear()
        elif len(dl) > 2 * self._len + 64:  # drop the ones no longer queued (bounded memory)
            self._deadlines = [d for d in dl if d[2].state == QUEUED]
            heapq.heapify(self._deadlines)

    # -- time ---------------------------------------------------------------------------------
    def expire(self, now: float) -> list[Entry[T]]:
        """Take out and return the requests whose deadline has passed."""
        out: list[Entry[T]] = []
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            entry = heapq.heappop(dl)[2]
            if entry.state == QUEUED:
                self._remove(entry)
                out.append(entry)
        return out

    def next_deadline(self) -> float | None:
        dl = self._deadlines
        while dl and dl[0][2].state != QUEUED:
            heapq.heappop(dl)
        return dl[0][0] if dl else None

    def refund(self, entry: Entry[T] | None, tokens: float, now: float) -> None:
        """A request sent to the pool was charged ``tokens`` it did not cost (the replica
        refused it before any output): the dispatch rate gives them back and, when it waited
        here (``entry``), the bands' minimum-share credits (its band paid them, the lower
        bands earned a share of them) and its tenant's finish tag too, so its later requests
        are not pushed back behind everyone else's. The finish tag: only what the band's
        virtual time has not passed yet (past that the charge no longer holds the tenant back,
        and its flow may be a new one)."""
        tokens = max(0.0, tokens)
        self._pace.give_back(tokens, now)
        b = self._bands.get(entry.band) if entry is not None and entry.dispatched else None
        if b is not None:  # the minimum shares: its band paid for them, the others earned
            self._charge(b, -tokens)  # a share of them (bands still waiting only)
        flow = b.flows.get(entry.tenant) if b is not None and entry is not None else None
        if b is None or flow is None or entry is None:
            return
        back = min(tokens / entry.weight, entry.delta, b.finish_now(entry) - b.vtime)
        if back <= 0:
            return
        for later in flow.items:  # queued behind it: tagged after its finish tag
            later.start -= back
            later.finish -= back
        flow.finish -= back
        if flow.items:
            heapq.heappush(b.heads, (flow.items[0].start, flow.items[0].seq, flow))

    def note_dispatch(self, cost: float, now: float) -> None:
        """``cost`` tokens went to the pool at ``now`` (queued or not): the dispatch rate."""
        self._pace.note(cost, now)

    @property
    def dispatched_tokens(self) -> float:
        return self._pace.dispatched_tokens

    def rate(self, now: float) -> float:
        """Dispatched tokens per second, averaged over about the rate window."""
        return self._pace.rate(now)

    def drain_rate(self, now: float) -> float:
        """Tokens per second the queue drains at (`DispatchPace.drain_rate`)."""
        return self._pace.drain_rate(now)

    def ahead(self, band: int) -> float:
        """Tokens queued that a new request of ``band`` would wait behind (its band and the
        ones above; fair sharing makes this an upper bound for a light tenant)."""
        return sum(b.cost for lv, b in self._bands.items() if lv <= band)

    def wait_estimate(self, band: int, now: float) -> float | None:
        """Seconds a new request of ``band`` would wait at the current dispatch rate (None:
        no dispatch seen recently to estimate from)."""
        rate = self.drain_rate(now)
        if rate <= 1e-9:
            return None
        return self.ahead(band) / rate

    def retry_after(self, band: int, now: float, waited: float = 0.0) -> int:
        """Whole seconds a request of ``band`` shed at ``now`` is told to wait (`Retry-After`):
        the queue ahead of it drained at the recent dispatch rate (`wait_estimate`). With no
        dispatch seen to estimate from, the queue has not moved for as long as its oldest
        request has waited, and for ``waited`` (the shed request's own wait): that long, not
        a second, which would bring every shed client back at once. Within
        `RETRY_AFTER_MIN_S`..`RETRY_AFTER_MAX_S`."""
        est = self.wait_estimate(band, now)
        if est is None:
            est = max(waited, now - self.oldest(now))
        return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, math.ceil(est)))

    # -- helpers ------------------------------------------------------------------------------
    def _band(self, level: int) -> Band[T]:
        b = self._bands.get(level)
        if b is None:
            b = self._bands[level] = Band(level)
            self._levels = sorted(self._bands)
        return b

