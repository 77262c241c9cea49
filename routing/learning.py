"""What the router learns online: each replica's prefill rate, and its own pending prefill work.

Prefill rate. When kvgate routes a request it predicts the prefill work (tokens) the replica
must do before that request's first token: the uncached work it had already been sent, plus
this request's uncached tokens. When the first token arrives after ``ttft_s``, the pair
(work, ttft_s) is one observation. The rate is the ratio of exponentially decayed sums,
started from a prior worth ``prior_weight_s`` seconds at ``prior_prefill_tps``; a slow
replica (AWQ vs FP8, a busy GPU) drifts to its own rate after a few requests, and one outlier
moves it only a little.

Pending work. Per replica, the predicted uncached tokens of requests routed there whose first
token has not arrived. Entries leave on the first token, on `drop`, or after ``ttl_s`` (a
request whose outcome kvgate never reported must not count forever).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["PendingWork", "PrefillRates", "Rate", "ReplicaPending"]


@dataclass(slots=True)
class Rate:
    work: float
    seconds: float


class PrefillRates:
    def __init__(self, prior_tps: float, prior_weight_s: float, decay: float, floor_tps: float):
        self._prior = Rate(prior_tps * prior_weight_s, prior_weight_s)
        self._decay = decay
        self._floor = floor_tps
        self._rates: dict[str, Rate] = {}

    def records(self) -> tuple[Mapping[str, Rate], Rate, float]:
        """(learned rates, the prior, the floor): raw access for the per-candidate hot loop."""
        return self._rates, self._prior, self._floor

    def rate(self, replica: str) -> float:
        r = self._rates.get(replica, self._prior)
        return max(self._floor, r.work / r.seconds)

    def observe(self, replica: str, work_tokens: float, ttft_s: float) -> None:
        if ttft_s <= 0.0 or work_tokens < 0.0:
            return
        r = self._rates.get(replica)
        if r is None:
            r = self._rates[replica] = Rate(self._prior.work, self._prior.seconds)
        r.work = r.work * self._decay + work_tokens
        r.seconds = r.seconds * self._decay + ttft_s

    def forget(self, replica: str) -> None:
        self._rates.pop(replica, None)


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
    by_key: dict[tuple[int, int], deque[_Entry]] = field(default_factory=dict)


class PendingWork:
    def __init__(self, ttl_s: float, prior_request_tokens: float) -> None:
        self._ttl = ttl_s
        # mean uncached tokens per routed request (EMA): the size of a request kvgate did not
        # send, e.g. one queued by another gateway replica
        self.mean_request_tokens = prior_request_tokens
        self._replicas: dict[str, ReplicaPending] = {}
        self._timeline: deque[_Entry] = deque()  # every entry, oldest first (for expiry)

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
        others: float = 0.0,
    ) -> float:
        """Record a routed request; returns the work ahead of its first token (incl. itself).
        ``others``: work queued there by other gateways (shared state), ahead of it too."""
        self.expire(now)
        self.mean_request_tokens += 0.05 * (uncached - self.mean_request_tokens)
        p = self._replicas.setdefault(replica, ReplicaPending())
        entry = _Entry(replica, key, uncached, p.total + others + uncached, now)
        p.by_key.setdefault(key, deque()).append(entry)
        p.total += uncached
        p.count += 1
        self._timeline.append(entry)
        return entry.work

    def pop(self, replica: str, key: tuple[int, int]) -> float | None:
        """Remove the oldest pending request with ``key``; returns its predicted work."""
        p = self._replicas.get(replica)
        queue = p.by_key.get(key) if p is not None else None
        if p is None or not queue:
            return None
        entry = queue.popleft()
        if not queue:
            del p.by_key[key]
        self._retire(p, entry)
        return entry.work

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

    def forget(self, replica: str) -> None:
        p = self._replicas.pop(replica, None)
        if p is not None:
            for queue in p.by_key.values():
                for entry in queue:
                    entry.live = False
