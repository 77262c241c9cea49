"""One pool's flow control as the gateway and the offline replay both run it: the saturation
rule in front of the queue. Pure (time and views passed in).

Per request: `admit` -- straight through when nothing is queued and the pool is not saturated
(work-conserving: no wait, no reordering); otherwise the caller `offer`s it to the queue.
Whenever capacity may have freed (a request answered or finished, a fresh scrape, a tick),
the caller asks `release` for the next request to send, one at a time, until it says None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic, TypeVar

from routing.flow.config import DEFAULT_MIN_SHARE, FlowConfig
from routing.flow.queue import Entry, FlowQueue, Offer
from routing.flow.saturation import pool_saturated, with_room
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
        peers: Mapping[str, ReplicaLoad] = _NO_PEERS,
    ) -> bool:
        """True: send it now (counted as dispatched). False: it must be offered to the queue."""
        if self.queue or pool_saturated(views, self.config.saturation, peers):
            return False
        self.queue.note_dispatch(cost, now)
        return True

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
        """The next queued request to send now, or None (nothing queued, or no room)."""
        if not self.queue or pool_saturated(views, self.config.saturation, peers):
            return None
        return self.queue.pop(now)

    def expire(self, now: float) -> list[Entry[T]]:
        return self.queue.expire(now)

    def remove(self, entry: Entry[T]) -> bool:
        return self.queue.remove(entry)
