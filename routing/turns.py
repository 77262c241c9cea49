"""Ranks and turns within the sync window: several gateways picking at one instant.

Peers' records arrive about a sync window late, so within it a gateway cannot see the others'
picks. `Turns` ranks this gateway among the live ones (by member id: an order they all agree
on) and keeps its own routes within the window; from them follows each pick's turn among the
picks all gateways make in the window (`PickContext.turn`). One per `routing.sharing.Sharing`.
Time is passed in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

from routing.peers import PeerLoads, ReplicaLoad
from routing.types import ReplicaView

__all__ = ["Turns"]


class Turns:
    """This gateway's rank and its own routes within the window (none while ``window`` is 0:
    `Sharing.enable` sets it)."""

    def __init__(self, replica_hashes: dict[str, int]) -> None:
        self.window = 0.0  # peers' records arrive about this late (`Router.enable_sharing`)
        self._hashes = replica_hashes  # the router's tie-break hash per replica
        self.recent: deque[tuple[float, str]] = deque()  # own routes within the window
        self._recent_counts: dict[str, int] = {}  # ... per replica
        self._ranked_members: tuple[str, ...] | None = None  # `rank` for these live peers
        self._ranked = (0, 1)

    def rank(self, peers: PeerLoads, member: str, now: float) -> tuple[int, int]:
        """(this gateway's rank among the live gateways, how many are live)."""
        members = peers.member_ids(now)  # the same tuple while membership holds
        if members is not self._ranked_members:
            self._ranked_members = members
            self._ranked = ((0, 1) if not members else
                            (sorted((*members, member)).index(member), len(members) + 1))
        return self._ranked

    def turn(
        self, views: Sequence[ReplicaView], peer_loads: Mapping[str, ReplicaLoad], now: float,
        rank: int, gateways: int,
    ) -> tuple[int, Callable[[], tuple[str, ...]]]:
        """This pick's turn among the picks all gateways make within the sync window, and the
        order the gateways agree on to take turns in (`PickContext.turn`; a function: the
        policy asks for it only when several candidates are about as good).

        Within the window a gateway cannot see the others' picks. Arrivals at one instant
        (a burst) split over N gateways; deciding on the same shared state, each would send its
        share to the same cheapest replicas. Requests being spread evenly over the gateways,
        while this one made ``k`` picks in the window each other one made about ``k`` too, and
        in this round those ranked before it one more: its turn is ``k x N + rank``. The order
        is the replicas by fleet-wide in-flight requests as all gateways knew them at the
        window's start (this gateway's own picks in the window taken out; ``peer_loads``: the
        others' when not in the views), then by a hash of the replica id: the same for every
        gateway."""
        recent = self.recent_picks(now)

        def order() -> tuple[str, ...]:
            own, hashes, pget = self._recent_counts, self._hashes, peer_loads.get
            keyed = []
            for v in views:
                p = pget(v.id)
                shared = v.inflight + (p.inflight if p is not None else 0) - own.get(v.id, 0)
                keyed.append((shared, hashes[v.id], v.id))
            keyed.sort()
            return tuple(k[2] for k in keyed)

        return len(recent) * gateways + rank, order

    def recent_picks(self, now: float) -> deque[tuple[float, str]]:
        """Our own routes within the last sync window (older ones dropped)."""
        recent, start, counts = self.recent, now - self.window, self._recent_counts
        while recent and recent[0][0] <= start:
            replica = recent.popleft()[1]
            if counts[replica] > 1:
                counts[replica] -= 1
            else:
                del counts[replica]
        return recent

    def routed(self, replica: str, now: float) -> None:
        """We routed a request to ``replica`` at ``now`` (kept while within the window)."""
        if self.window > 0:
            recent = self.recent
            if recent and recent[0][0] <= now - self.window:  # (`pick` pruned it already)
                self.recent_picks(now)
            recent.append((now, replica))
            self._recent_counts[replica] = self._recent_counts.get(replica, 0) + 1
