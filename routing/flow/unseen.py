"""Other gateways' sends not seen yet: the saturation rule's margin for a burst split over
several gateways. Pure (time passed in).

A gateway learns what its peers sent to a replica from their records, which arrive a record's
lag late (a flush interval in the publisher's outbox, Redis, the reader's loop: 10-40 ms on an
idle machine, more on a loaded one). Within that lag a burst arriving at N gateways at once is
admitted by each against the fleet's load as it was before the burst: each lets through up to
the whole bound, and the replicas got up to N times it. `UnseenPicks` keeps this gateway's own
picks within the lag and `loads` adds to the peers' published load, per replica, what they may
have sent there unseen meanwhile: as many requests, with as many prompt tokens, as this
gateway sent there, from each of the N - 1 others (a burst splits about evenly over the
gateways in front of it). Each gateway then takes about 1 / N of the room the fleet had when
the burst began, and together they fill it, not N times it. The price: a peer's request seen
already is counted twice until the lag has passed, so a gateway holds back up to its own
picks of the last lag (times N - 1) below the bound; never more than the bound goes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from routing.peers import ReplicaLoad

__all__ = ["UnseenPicks"]


class UnseenPicks:
    """This gateway's picks within the last ``window`` seconds (none kept while it is 0)."""

    def __init__(self, window: float = 0.0) -> None:
        self.window = window
        self._picks: deque[tuple[float, str, int]] = deque()  # (when, replica, prompt tokens)

    def __len__(self) -> int:
        return len(self._picks)

    def picked(self, replica: str, tokens: int, now: float) -> None:
        """This gateway sent a request of ``tokens`` prompt tokens to ``replica`` at ``now``."""
        if self.window > 0.0:
            self._prune(now)
            self._picks.append((now, replica, max(0, tokens)))

    def loads(
        self, totals: Mapping[str, ReplicaLoad], others: int, now: float
    ) -> Mapping[str, ReplicaLoad]:
        """``totals`` (the peers' published load per replica) plus, on each replica this
        gateway picked within the window, ``others`` times its requests and prompt tokens
        sent there meanwhile, as requests in flight and not answered. ``totals`` itself
        when there is nothing to add."""
        self._prune(now)
        if others <= 0 or not self._picks:
            return totals
        sent: dict[str, tuple[int, int]] = {}
        for _, replica, tokens in self._picks:
            n, t = sent.get(replica, (0, 0))
            sent[replica] = (n + 1, t + tokens)
        out = dict(totals)
        for replica, (n, t) in sent.items():
            unseen = ReplicaLoad(n * others, n * others, t * others)
            have = out.get(replica)
            out[replica] = unseen if have is None else have + unseen
        return out

    def _prune(self, now: float) -> None:
        picks, start = self._picks, now - self.window
        while picks and picks[0][0] <= start:
            picks.popleft()
