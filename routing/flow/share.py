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
part of what a tenant holds at a time.

`routing.flow.gate.PoolFlow` holds an over-share tenant back while the pool is near
saturation and others pass it (the rule: ``docs/flow-control.md``). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["Holdings"]


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

    def over(self, tenant: str, waiting: Mapping[str, float], factor: float = 1.0) -> bool:
        """Whether ``tenant`` holds more than ``factor`` times its share (as `over_share`)."""
        held = self._held.get(tenant)
        if held is None or (len(self._held) < 2 and not any(t != tenant for t in waiting)):
            return False
        return held.tokens * self._weights(waiting) > factor * held.weight * self.total

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
