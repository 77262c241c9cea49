"""Each tenant's share of a pool's in-flight work, and who holds more than its fair share.

Fair queueing orders what waits; it does not bound what a tenant already holds. A tenant
sending far more than its share keeps its excess queued, and every seat that frees while
nobody else waits goes to it: the replicas run at the saturation bound and everyone else's
requests meet a full pool and a deep prefill queue. `Holdings` counts the tokens (prompt +
expected output, the unit fair sharing charges) of every request a pool was sent and has not
finished, per tenant. A tenant is *over its share* when it holds more than ``factor`` times
``weight / sum(weights)`` of the pool's in-flight tokens, the sum taken over the tenants that
hold work in the pool or wait in its queue. A tenant alone is never over its share. The
factor leaves room for what an even split misses: tenants' demands differ (a tier of 4
tenants with 70 % of the traffic against one of 4 with 30 %), and one long prompt is a large
part of what a tenant holds at a time. `SendRates` averages the tokens each tenant was sent
lately: over its share of those too, a tenant is taking more than its share rather than
holding one long prompt.

`routing.flow.gate.PoolFlow` lets others pass an over-share tenant, and sends one over both
shares only to replicas with spare room (the rule: ``docs/flow-control.md``). Pure: no clock
(time passed in), no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["Holdings", "SendRates"]


class _Held:
    __slots__ = ("count", "tokens", "weight")

    def __init__(self, weight: float) -> None:
        self.count = 0
        self.tokens = 0.0
        self.weight = weight


class Holdings:
    """Tokens in flight per tenant in one pool (sent, not finished)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self.total = 0.0

    def __len__(self) -> int:
        """Tenants holding work."""
        return len(self._held)

    def add(self, tenant: str, cost: float, weight: float = 1.0) -> None:
        """A request of ``tenant`` costing ``cost`` tokens was sent."""
        held = self._held.get(tenant)
        if held is None:
            held = self._held[tenant] = _Held(weight)
        held.weight = weight
        held.count += 1
        held.tokens += cost
        self.total += cost

    def remove(self, tenant: str, cost: float) -> None:
        """One of ``tenant``'s requests finished (answered, failed or abandoned)."""
        held = self._held.get(tenant)
        if held is None:
            return
        held.count -= 1
        if held.count <= 0:
            del self._held[tenant]
            self.total -= held.tokens
        else:
            held.tokens -= cost
            self.total -= cost
        if not self._held:
            self.total = 0.0  # no float residue once the pool is empty

    def tokens(self, tenant: str) -> float:
        held = self._held.get(tenant)
        return held.tokens if held is not None else 0.0

    def due(
        self, tenant: str, waiting: Mapping[str, float], factor: float = 1.0, less: float = 0.0
    ) -> float | None:
        """The part of the in-flight tokens ``tenant`` may hold: ``factor`` times its weight
        over the sum of weights (`over_share`). None when it cannot be over its share: it holds
        nothing or is alone; with ``less``: before one of its requests of that many tokens
        was added."""
        held = self._held.get(tenant)
        if held is None or (less and held.count <= 1):
            return None
        if len(self._held) < 2 and not any(t != tenant for t in waiting):
            return None
        return factor * held.weight / self._weights(waiting)

    def over(
        self, tenant: str, waiting: Mapping[str, float], factor: float = 1.0, less: float = 0.0
    ) -> bool:
        """Whether ``tenant`` holds more than ``factor`` times its share (as `over_share`);
        with ``less``: before one of its requests of that many tokens was added."""
        due = self.due(tenant, waiting, factor, less)
        return due is not None and self.tokens(tenant) - less > due * (self.total - less)

    def _weights(self, waiting: Mapping[str, float]) -> float:
        held = self._held
        return (sum(h.weight for h in held.values())
                + sum(w for t, w in waiting.items() if t not in held))

    def over_share(self, waiting: Mapping[str, float], factor: float = 1.0) -> set[str]:
        """The tenants holding more than ``factor`` times their weighted fair share of the
        in-flight tokens; ``waiting``: the queued tenants -> their weight (they count in the
        sum of weights)."""
        held = self._held
        if len(held) < 2 and not any(t not in held for t in waiting):
            return set()
        weights, total = self._weights(waiting), self.total
        return {t for t, h in held.items() if h.tokens * weights > factor * h.weight * total}


class SendRates:
    """Tokens sent per tenant, averaged over about ``window_s`` (exponentially weighted, as
    the queue's dispatch rate): who has been taking more than its share lately, not only at
    this instant. Memory: the tenants that sent within the last `FORGET` windows (checked
    every `PRUNE_EVERY` sends)."""

    FORGET = 20  # windows: a rate that old has decayed to e^-20 of itself
    PRUNE_EVERY = 1024

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._rate: dict[str, tuple[float, float]] = {}  # tenant -> (tokens/s, at)
        self._sends = 0

    def __len__(self) -> int:
        return len(self._rate)

    def add(self, tenant: str, cost: float, now: float) -> None:
        """``tenant`` sent ``cost`` tokens at ``now``."""
        self._rate[tenant] = (self.rate(tenant, now) + cost / self.window_s, now)
        self._sends += 1
        if self._sends % self.PRUNE_EVERY == 0:
            horizon = now - self.FORGET * self.window_s
            self._rate = {t: r for t, r in self._rate.items() if r[1] > horizon}

    def refund(self, tenant: str, tokens: float, now: float) -> None:
        """``tenant`` was charged ``tokens`` at a send that did not cost them."""
        if tenant in self._rate:
            self._rate[tenant] = (max(0.0, self.rate(tenant, now) - tokens / self.window_s), now)

    def rate(self, tenant: str, now: float) -> float:
        """Its tokens per second at ``now``."""
        r = self._rate.get(tenant)
        if r is None:
            return 0.0
        dt = now - r[1]
        return r[0] * math.exp(-dt / self.window_s) if dt > 0 else r[0]
