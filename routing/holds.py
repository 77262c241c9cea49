"""Whether a contested pick is worth holding (`Router.defer_s`): what a hold can gain against
what it costs.

A gateway ranked r holds a contested pick r hold windows so that the lower ranks' picks of the
same instant reach it first. That wait is certain and the request's own (on a ~40 ms first
token, a 10-30 ms hold is most of it); what it buys is a chance: that one of the lower ranks'
picks it cannot see yet lands on the replica it would pick blind, and its request then waits
for that pick's prefill. So a pick is held only when

    unseen x collision_s / near > hold

``unseen``: the lower ranks' picks expected within the window it is blind to; ``near``: the
candidates about as good it would pick among (the policy's `contested`), each as likely;
``collision_s``: a mean request's prefill at the fleet's rate (`routing.learning`).
``unseen`` is the larger of two estimates: in a burst each gateway makes about as many picks
as this one made within the last window (its holds included), per lower rank; otherwise the
lower ranks' routes applied over the last ``RATE_WINDOWS`` windows, per window (one window
alone: a single route applied, which is what makes a pick look like part of a burst, counted
as a whole pick per window; heavy-tail's one-by-one arrivals were then held at 4 gateways,
p50 1.09x one gateway's on the mean of three seeds, where no holds gave 1.07x on one).
"""

from __future__ import annotations

from collections import deque

__all__ = ["RATE_WINDOWS", "HoldOdds"]

RATE_WINDOWS = 4  # the lower ranks' route rate is counted over this many sync windows


class HoldOdds:
    """The counts behind `worth`: the lower ranks' routes applied lately, this gateway's holds
    within the window. Peers are ranked by member id, as `Turns.rank` ranks them."""

    def __init__(self, member: str, window_s: float) -> None:
        self._member = member
        self._window = window_s
        self._lower: deque[tuple[float, int]] = deque()  # (applied at, routes) of lower ranks
        self._holds: deque[float] = deque()  # holds asked for (`held`)

    def peer_routed(self, member: str, routes: int, now: float) -> None:
        """Gateway ``member``'s live routes were applied at ``now``."""
        if member < self._member:
            self._lower.append((now, routes))
            self._prune_lower(now)

    def held(self, now: float) -> None:
        """A pick is held from ``now`` (it is routed, and counted as a pick, after the window)."""
        self._holds.append(now)

    def unseen(self, now: float, rank: int, own_picks: int) -> float:
        """The lower ranks' picks expected within the window before ``now`` (module docstring);
        ``own_picks``: this gateway's routes within it."""
        holds = self._holds
        start = now - self._window
        while holds and holds[0] <= start:
            holds.popleft()
        self._prune_lower(now)
        rate = sum(n for _, n in self._lower) / RATE_WINDOWS
        burst = float(rank * (own_picks + len(holds)))
        return burst if burst > rate else rate

    def _prune_lower(self, now: float) -> None:
        lower, start = self._lower, now - RATE_WINDOWS * self._window
        while lower and lower[0][0] <= start:
            lower.popleft()

    def worth(
        self, now: float, rank: int, own_picks: int, near: int, collision_s: float, hold_s: float,
    ) -> bool:
        """Whether holding a pick among ``near`` candidates ``hold_s`` is expected to spare it
        more than that: ``collision_s`` per lower-rank pick landing on its replica."""
        return self.unseen(now, rank, own_picks) * collision_s / near > hold_s
