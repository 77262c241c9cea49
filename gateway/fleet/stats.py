"""The shared routing state's counters (`SyncStats`): entries published and applied, records
dropped by reason, whether Redis answers, and the apply lag, read by `gateway.fleet.metrics`."""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

__all__ = ["LAG_BUCKETS", "SyncStats"]

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class SyncStats:
    """Counters the metrics collector reads."""

    published: int = 0  # stream entries written
    applied: int = 0  # peers' entries applied
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> entries or routes
    up: bool = False
    # apply lag (written to Redis -> applied here, on Redis's clock: `RedisClock`): a
    # histogram, and the recent values
    lag_buckets: list[int] = field(default_factory=lambda: [0] * len(LAG_BUCKETS))
    lag_count: int = 0
    lag_sum: float = 0.0
    recent_lags: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def drop(self, reason: str, n: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + n

    def lag(self, seconds: float) -> None:
        self.lag_count += 1
        self.lag_sum += seconds
        self.recent_lags.append(seconds)
        i = bisect_left(LAG_BUCKETS, seconds)
        if i < len(LAG_BUCKETS):
            self.lag_buckets[i] += 1
