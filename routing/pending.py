"""Pending work: the queue the router predicts ahead of each replica's next first token.

Per replica, the predicted uncached tokens of requests routed there whose first
token has not arrived. Entries leave on the first token, on `drop`, or after ``ttl_s`` (a
request whose outcome kvgate never reported must not count forever). What is left of it is a
queue drained at the replica's learned rate, which other gateways' work sent there joins
(`PendingWork.arrived`, shared state): the replica works through everyone's requests, so ours
drains only as theirs does. Drained alone while theirs counted in full, four gateways each
saw their own queues as nearly done and piled onto them (load-ramp at 262,144: the work
predicted ahead of a pick ~0.5x the engine's true backlog, the fits learned from those first
tokens ~10k prompt tokens/s where the engines prefilled ~18k; docs/shared-state-measurements.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["PendingWork", "ReplicaPending"]


@dataclass(slots=True)
class _Entry:
    replica: str
    key: tuple[int, int]
    uncached: float
    work: float
    at: float
    live: bool = True


@dataclass(slots=True)
class ReplicaPending:
    total: float = 0.0
    count: int = 0
    # predicted work not yet done at `fluid_at`, ours and (shared state) other gateways'
    # sent there since: one queue, drained at the replica's rate
    fluid: float = 0.0
    fluid_at: float = 0.0
    by_key: dict[tuple[int, int], deque[_Entry]] = field(default_factory=dict)

    def fluid_left(self, now: float, rate: float, others: float = 0.0) -> float:
        """The queue's work left at ``now``: at most our pending work plus ``others``
        (other gateways' pending work there, as they last published it)."""
        left = self.fluid - rate * (now - self.fluid_at)
        cap = self.total + others
        return min(cap, left) if left > 0.0 else 0.0


class PendingWork:
    def __init__(self, ttl_s: float, prior_request_tokens: float) -> None:
        self._ttl = ttl_s
        # mean uncached tokens per routed request (EMA): the size of a request kvgate did not
        # send, e.g. one queued by another gateway replica
        self.mean_request_tokens = prior_request_tokens
        self._replicas: dict[str, ReplicaPending] = {}
        self._timeline: deque[_Entry] = deque()  # every entry, oldest first (for expiry)
        self._sweep_at = 0.0  # replicas with nothing pending are swept then (`expire`)

    def total(self, replica: str) -> float:
        p = self._replicas.get(replica)
        return p.total if p is not None else 0.0

    def load(self, replica: str) -> tuple[float, int]:
        """(pending uncached tokens, pending requests) on ``replica``."""
        p = self._replicas.get(replica)
        return (p.total, p.count) if p is not None else (0.0, 0)

    def records(self) -> Mapping[str, ReplicaPending]:
        """Pending work per replica: raw access for the per-candidate hot loop."""
        return self._replicas

    def count(self, replica: str) -> int:
        p = self._replicas.get(replica)
        return p.count if p is not None else 0

    def add(
        self, replica: str, key: tuple[int, int], uncached: float, now: float,
        others: float = 0.0, rate: float = 0.0,
    ) -> float:
        """Record a routed request; returns the work ahead of its first token (incl. itself).
        ``others``: other gateways' pending work there (shared state); what of it is left
        is ahead of the request too (`arrived`)."""
        self.expire(now)
        self.mean_request_tokens += 0.05 * (uncached - self.mean_request_tokens)
        p = self._replicas.setdefault(replica, ReplicaPending())
        ahead = p.fluid_left(now, rate, others) if rate > 0 else p.total + others
        p.fluid, p.fluid_at = ahead + uncached, now
        entry = _Entry(replica, key, uncached, ahead + uncached, now)
        p.by_key.setdefault(key, deque()).append(entry)
        p.total += uncached
        p.count += 1
        self._timeline.append(entry)
        return entry.work

    def arrived(self, replica: str, work: float, now: float, rate: float, others: float) -> None:
        """Other gateways sent ``work`` more to ``replica`` (their published pending work
        there grew; ``others``: its sum before): it queues with ours. Drained alone, our
        own work would look done while the replica was prefilling theirs."""
        self.expire(now)
        p = self._replicas.setdefault(replica, ReplicaPending())
        p.fluid, p.fluid_at = p.fluid_left(now, rate, others) + work, now

    def pop(self, replica: str, key: tuple[int, int]) -> tuple[float, float] | None:
        """Remove the oldest pending request with ``key``; returns (the work predicted ahead
        of its first token, its own part of it)."""
        p = self._replicas.get(replica)
        queue = p.by_key.get(key) if p is not None else None
        if p is None or not queue:
            return None
        entry = queue.popleft()
        if not queue:
            del p.by_key[key]
        self._retire(p, entry)
        return entry.work, entry.uncached

    def _retire(self, p: ReplicaPending, entry: _Entry) -> None:
        entry.live = False
        p.count -= 1
        p.total = max(0.0, p.total - entry.uncached)
        if not p.by_key:
            p.total = 0.0  # no drift from float rounding once empty

    def expire(self, now: float) -> None:
        timeline = self._timeline
        while timeline and (not timeline[0].live or now - timeline[0].at > self._ttl):
            entry = timeline.popleft()
            if not entry.live:
                continue
            p = self._replicas.get(entry.replica)
            queue = p.by_key.get(entry.key) if p is not None else None
            if p is None or not queue:
                continue
            queue.remove(entry)
            if not queue:
                del p.by_key[entry.key]
            self._retire(p, entry)
        if now >= self._sweep_at:
            # a replica with none of ours pending whose queue nothing joined for ``ttl_s``
            # goes (as its requests would have): other gateways' work joins the queue of any
            # replica they publish (`arrived`), those that left the pool too, after `forget`
            self._sweep_at = now + self._ttl
            idle = [r for r, p in self._replicas.items()
                    if not p.count and now - p.fluid_at > self._ttl]
            for replica in idle:
                del self._replicas[replica]

    def forget(self, replica: str) -> None:
        p = self._replicas.pop(replica, None)
        if p is not None:
            for queue in p.by_key.values():
                for entry in queue:
                    entry.live = False
