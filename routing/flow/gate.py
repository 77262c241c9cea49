"""One pool's flow control as the gateway and the offline replay both run it: the saturation
rule in front of the queue. Pure (time and views passed in).

Per request: `admit` -- straight through when nothing is queued and the pool is not saturated
(work-conserving: no wait, no reordering); otherwise the caller `offer`s it to the queue.
Whenever capacity may have freed (a request answered or finished, a fresh scrape, a tick),
the caller asks `release` for the next request to send, one at a time, until it says None.
Every request sent (admitted, released, or spilled here: `sent`) is the pool's until the
caller says it is `done`.

**The share cap** (``FlowConfig.share_cap``): a tenant holding more than ``share_cap`` times
its weighted fair share of the pool's in-flight tokens (`routing.flow.share`) is passed over
by the other tenants of its band when `release` gives the band its turn (the cap reorders
tenants, never bands), and, while the pool is *near* saturation (the rule with its bounds
scaled by ``1 - share_headroom``), it waits even when nobody else in its band does: `admit`
queues it and `release` gives the turn to the next band. The headroom it leaves is what the
other tenants' requests find free when they arrive. A tenant alone in the pool is never over
its share; with ``share_headroom`` 0 the cap is work-conserving (an over-share tenant waits
only while another tenant of its band does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

from routing.flow.config import DEFAULT_MIN_SHARE, FlowConfig
from routing.flow.queue import Entry, FlowQueue, Offer
from routing.flow.saturation import pool_saturated, with_room
from routing.flow.share import Holdings
from routing.peers import ReplicaLoad
from routing.types import ReplicaView

__all__ = ["PoolFlow", "request_cost"]

T = TypeVar("T")
_NO_PEERS: Mapping[str, ReplicaLoad] = {}


def request_cost(prompt_tokens: int, max_tokens: int | None, expected_output: int) -> float:
    """What fair sharing charges a request: its prompt plus its expected output (``max_tokens``
    when the client set it, else the configured expectation)."""
    out = max_tokens if max_tokens is not None and max_tokens >= 0 else expected_output
    return float(max(0, prompt_tokens) + out)


class PoolFlow(Generic[T]):
    def __init__(
        self, config: FlowConfig, min_share: Mapping[int, float] | None = None,
        default_min_share: float = DEFAULT_MIN_SHARE,
    ) -> None:
        self.config = config
        self.queue: FlowQueue[T] = FlowQueue(
            config.max_queue, min_share, default_min_share, config.rate_window_s)
        self.holdings = Holdings()
        self._near = config.saturation.scaled(1.0 - config.share_headroom)

    def __len__(self) -> int:
        """Requests queued."""
        return len(self.queue)

    def saturated(
        self, views: Sequence[ReplicaView], peers: Mapping[str, ReplicaLoad] = _NO_PEERS
    ) -> bool:
        return pool_saturated(views, self.config.saturation, peers)

    def with_room(
        self, views: Sequence[ReplicaView], peers: Mapping[str, ReplicaLoad] = _NO_PEERS,
        tokens: int = 0,
    ) -> list[ReplicaView]:
        """The views to route a ``tokens``-token prompt from: the replicas without room for
        it marked unhealthy (`saturation.with_room`)."""
        return with_room(views, self.config.saturation, peers, tokens)

    def admit(
        self, views: Sequence[ReplicaView], cost: float, now: float,
        peers: Mapping[str, ReplicaLoad] = _NO_PEERS, tenant: str = "", weight: float = 1.0,
    ) -> bool:
        """True: send it now (counted as `sent`). False: it must be offered to the queue."""
        rule = self.config.saturation
        if self.queue or pool_saturated(views, rule, peers):
            return False
        cap = self.config.share_cap
        if (cap is not None and self._near is not rule and self.holdings.over(tenant, {}, cap)
                and pool_saturated(views, self._near, peers)):
            return False  # over its share, the pool near saturation: the headroom is others'
        self.sent(tenant, cost, now, weight)
        return True

    def sent(self, tenant: str, cost: float, now: float, weight: float = 1.0) -> None:
        """A request of ``tenant`` went to the pool without waiting in its queue."""
        self.queue.note_dispatch(cost, now)
        self.holdings.add(tenant, cost, weight)

    def done(self, tenant: str, cost: float) -> None:
        """A request sent to the pool finished (answered, failed, or abandoned)."""
        self.holdings.remove(tenant, cost)

    def over_share(self, tenant: str) -> bool:
        """Whether ``tenant`` holds more than its share of the pool's in-flight tokens."""
        cap = self.config.share_cap
        return cap is not None and self.holdings.over(tenant, self.queue.waiting(), cap)

    def offer(
        self, handle: T, *, tenant: str, band: int, cost: float, now: float,
        max_wait_s: float, weight: float = 1.0, tier: str = "",
    ) -> Offer[T]:
        return self.queue.offer(handle, tenant=tenant, band=band, cost=cost, now=now,
                                max_wait_s=max_wait_s, weight=weight, tier=tier)

    def release(
        self, views: Sequence[ReplicaView], now: float,
        peers: Mapping[str, ReplicaLoad] = _NO_PEERS,
    ) -> Entry[T] | None:
        """The next queued request to send now, or None (nothing queued, no room, or only
        over-share tenants wait and the pool is near saturation)."""
        queue, rule = self.queue, self.config.saturation
        if not queue or pool_saturated(views, rule, peers):
            return None
        cap = self.config.share_cap
        over = set() if cap is None else self.holdings.over_share(queue.waiting(), cap)
        # over-share tenants are passed over inside their band; near saturation they wait
        # even when nobody else in it does (the turn goes to the next band)
        hold = bool(over) and self._near is not rule and pool_saturated(views, self._near, peers)
        entry = queue.pop(now, over, hold)
        if entry is not None:
            self.holdings.add(entry.tenant, entry.cost, entry.weight)
        return entry

    def pop(self, now: float) -> Entry[T] | None:
        """The next queued request in the queue's order, room or not."""
        entry = self.queue.pop(now)
        if entry is not None:
            self.holdings.add(entry.tenant, entry.cost, entry.weight)
        return entry

    def expire(self, now: float) -> list[Entry[T]]:
        return self.queue.expire(now)

    def remove(self, entry: Entry[T]) -> bool:
        return self.queue.remove(entry)
