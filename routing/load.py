"""Load views the policies share: the bounded-load rule, reconciled queues, stable tie-breaks.

Bounded load (consistent hashing with bounded loads, Mirrokni, Thorup & Zadimoghaddam 2017):
with L requests in flight over n healthy replicas, a replica may take one more only if its
load afterwards stays within ``c x (L + 1) / n + slack``. The least-loaded replica always
qualifies (its load is at most L / n), so the rule never leaves a request without a replica,
and under any arrival sequence no replica exceeds ``c x`` the pool mean plus the slack.
"""

from __future__ import annotations

from collections.abc import Sequence

from xxhash import xxh3_64_intdigest

from routing.types import ReplicaView

__all__ = ["LoadBound", "bound_limit", "fresh", "mix", "replica_hash", "still_running"]

_MASK64 = (1 << 64) - 1


def replica_hash(replica: str) -> int:
    return xxh3_64_intdigest(replica.encode())


def mix(key: int, replica_h: int) -> int:
    """A stable pseudo-random rank of a replica for one request key (one multiply-xorshift
    round over key XOR replica hash: cheap, and ample to order a few dozen replicas)."""
    z = ((key ^ replica_h) * 0x9E3779B97F4A7C15) & _MASK64
    return z ^ (z >> 29)


def fresh(view: ReplicaView, stale_after_s: float) -> bool:
    """Whether the scraped fields of ``view`` may be used (fail open when stale or missing)."""
    return view.scrape_age_s is not None and view.scrape_age_s <= stale_after_s


def still_running(scraped: float | None, ended_since: int) -> float | None:
    """An engine's scraped ``running`` less the gateway's requests that were in flight at that
    scrape and have ended since: the page still counts them (a scrape is up to an interval
    old), and a conversation's next turn, sent right after the last one ended, found its
    replica charged with the turn it follows and went elsewhere."""
    if scraped is None or not ended_since:
        return scraped
    return scraped - ended_since if scraped > ended_since else 0.0


def bound_limit(total: int, n: int, factor: float, slack: float) -> float:
    """The most requests in flight a replica may have and take one more, with ``total`` in
    flight over ``n`` candidates: load after assignment <= factor x mean_after + slack,
    mean_after = (total + 1) / n."""
    return factor * (total + 1) / n + slack - 1.0


class LoadBound:
    """The bounded-load rule over one candidate set."""

    __slots__ = ("limit",)

    def __init__(
        self, views: Sequence[ReplicaView], factor: float, slack: float,
        left_out: tuple[int, int] = (0, 0),
    ) -> None:
        """``left_out``: the in-flight requests and number of candidates the bound counts
        beside ``views`` (`PickContext.left_out`)."""
        self.limit = bound_limit(sum(v.inflight for v in views) + left_out[0],
                                 len(views) + left_out[1], factor, slack)

    def admits(self, view: ReplicaView) -> bool:
        return view.inflight <= self.limit + 1e-9
