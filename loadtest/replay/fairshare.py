"""The fair-share yardstick of the flow-control benchmarks: what each tenant was released from
the queue against what max-min fairness owed it, window by window while it waited.

A queue that drains serves every request it keeps, so tokens summed over a run say what the
tenants asked for, not what the scheduler decided; and one release at a time is no yardstick
either (a single large request is most of a moment's tokens). Here time is cut into windows
(``window_s``, per gateway and band). In each window a tenant's *demand* is the tokens it had
queued at the start plus what it queued during it; the tokens the band released in the window
are what there was to share, and a tenant's *due* is its weighted max-min share of them given
the demands: a tenant that asked for less than its weighted share is owed what it asked for,
the rest goes to the others by weight. A tenant still waiting at the next window asks again,
so a request held back for many windows is owed in each. Per tenant, released / due over the
run: 1.0 is exactly fair; below 1, it got less than its share while it waited.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["FairShareMeter", "max_min"]


def max_min(total: float, demand: Mapping[str, float], weight: Mapping[str, float]
            ) -> dict[str, float]:
    """``total`` shared by weight among ``demand``'s tenants, none given more than it asked
    for (water-filling; what a satisfied tenant leaves goes to the others by weight)."""
    out = {t: 0.0 for t in demand}
    open_ = {t for t, d in demand.items() if d > 0}
    left = total
    while open_ and left > 1e-9:
        weights = sum(weight.get(t, 1.0) for t in open_)
        level = left / weights  # tokens per unit of weight this round
        full = {t for t in open_ if demand[t] - out[t] <= level * weight.get(t, 1.0)}
        if not full:
            for t in open_:
                out[t] += level * weight.get(t, 1.0)
            break
        for t in full:
            left -= demand[t] - out[t]
            out[t] = demand[t]
        open_ -= full
    return out


@dataclass(slots=True)
class _Window:
    start: float
    demand: dict[str, float] = field(default_factory=dict)
    released: dict[str, float] = field(default_factory=dict)


class FairShareMeter:
    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._windows: dict[tuple[str, int], _Window] = {}
        self._backlog: dict[tuple[str, int], dict[str, float]] = {}
        self._weight: dict[str, float] = {}
        # tenant -> [tokens released, tokens due]
        self.totals: dict[str, list[float]] = {}
        self.windows = 0  # windows judged (two tenants or more waited, something released)

    def queued(self, key: tuple[str, int], tenant: str, cost: float, weight: float,
               now: float) -> None:
        """``tenant`` (of weight ``weight``) queued ``cost`` tokens in ``key`` (gateway, band)."""
        w = self._window(key, now)
        w.demand[tenant] = w.demand.get(tenant, 0.0) + cost
        backlog = self._backlog.setdefault(key, {})
        backlog[tenant] = backlog.get(tenant, 0.0) + cost
        self._weight[tenant] = weight

    def released(self, key: tuple[str, int], tenant: str, cost: float, now: float) -> None:
        w = self._window(key, now)
        w.released[tenant] = w.released.get(tenant, 0.0) + cost
        self._unqueue(key, tenant, cost)

    def dropped(self, key: tuple[str, int], tenant: str, cost: float) -> None:
        """A queued request left without being released (shed, displaced)."""
        self._unqueue(key, tenant, cost)

    def ratios(self) -> dict[str, float]:
        """Tenant -> released / due, over every window closed so far and the open ones."""
        for key, w in list(self._windows.items()):
            self._close(w)
            del self._windows[key]
        return {t: round(got / due, 4) for t, (got, due) in sorted(self.totals.items())
                if due > 0}

    def _unqueue(self, key: tuple[str, int], tenant: str, cost: float) -> None:
        backlog = self._backlog[key]
        left = backlog.get(tenant, 0.0) - cost
        if left > 1e-6:
            backlog[tenant] = left
        else:
            backlog.pop(tenant, None)

    def _window(self, key: tuple[str, int], now: float) -> _Window:
        w = self._windows.get(key)
        if w is not None and now < w.start + self.window_s:
            return w
        if w is not None:
            self._close(w)
        start = now if w is None else w.start + self.window_s * int(
            (now - w.start) // self.window_s)
        w = self._windows[key] = _Window(start, dict(self._backlog.get(key, {})))
        return w

    def _close(self, w: _Window) -> None:
        total = sum(w.released.values())
        if total <= 0 or len(w.demand) < 2:
            return  # nothing shared, or nobody to share with: nothing to judge
        self.windows += 1
        due = max_min(total, w.demand, self._weight)
        for tenant, owed in due.items():
            row = self.totals.setdefault(tenant, [0.0, 0.0])
            row[0] += w.released.get(tenant, 0.0)
            row[1] += owed
