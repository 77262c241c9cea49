"""Each replica's run of vLLM 500s for a request that no other try told the fault of (both
edges: `Relay`, the picker's `AnswerSide`).

A replica's 500 for one request (`verdicts.internal_error`, not a dead engine's) is tried on
one other replica (Envoy: the next endpoint); a success there charges the first one, a second
500 is the client's answer and neither replica is charged -- the request fails wherever it
runs. But two replicas that answer 500 to everything then acquit each other every time a
retry meets the other one: one whose retries always went to the other stayed in rotation
until that one was ejected (its clients got the 500 meanwhile). So each acquitted 500 adds
to its replica's streak,
which a success of that replica ends; a streak that reaches ``health.failure_threshold``
while another replica of the pool served a request is charged whole (that many failures: the
consecutive failures that eject), and a new one starts. A pool whose every replica fails
alike (a fleet-wide bug, or every request a poison one) serves nothing meanwhile: nothing is
charged, no replica ejected.

With authentication on, a streak is charged only once its 500s came from two tenants or
more: one tenant's requests that fail wherever they run (a poisoned prompt, an image URL no
replica can fetch) met on two replicas every time, and its 3 such requests in a row, while
another tenant's requests went to a third replica, ejected the first two for everyone. A
replica that fails everything fails every tenant's requests. Without authentication every
request is one tenant's (None): charged as before.
"""

from __future__ import annotations

from gateway.replicas import Replica

__all__ = ["ErrorStreaks"]


class ErrorStreaks:
    """The acquitted 500s of one gateway process's replicas (`acquitted`), and their pools'
    successes (`served`)."""

    __slots__ = ("_served", "_streaks", "_threshold")

    def __init__(self, threshold: int) -> None:
        self._threshold = max(1, threshold)
        self._served: dict[str, int] = {}  # pool -> requests its replicas served well
        # (pool, replica id) -> acquitted 500s in a row, its pool's `_served` at the first,
        # and the tenants they came from
        self._streaks: dict[tuple[str, str], tuple[int, int, frozenset[str | None]]] = {}

    def served(self, replica: Replica) -> None:
        """`replica` answered a request well: its streak ends; its pool served one."""
        self._served[replica.pool] = self._served.get(replica.pool, 0) + 1
        self._streaks.pop((replica.pool, replica.id), None)

    def acquitted(self, replica: Replica, now: float, tenant: str | None = None) -> None:
        """`replica` answered a request of `tenant` (None: authentication off) 500 that
        another replica failed alike, or a 500 error event after its stream's output began
        (`Relay._ended`: no other replica could try it), not charged for it: charged its streak's
        failures once the streak is long enough, another replica served meanwhile and (with
        authentication) two tenants or more met them."""
        key, served = (replica.pool, replica.id), self._served.get(replica.pool, 0)
        count, mark, tenants = self._streaks.get(key, (0, served, frozenset()))
        count += 1
        if len(tenants) < 2:  # two tell enough: the set stays small whoever sends
            tenants |= {tenant}
        if count < self._threshold or served == mark or (
                tenant is not None and len(tenants) < 2):
            self._streaks[key] = (count, mark, tenants)
            return
        del self._streaks[key]
        for _ in range(count):
            replica.record_failure(now)
