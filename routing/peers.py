"""Other gateways' records: what they routed, and the load they keep on each replica.

Several gateway processes (replicas of a Deployment, worker processes of one pod) route for
the same fleet. Each publishes what it routed (`RouteRecord`: a replica and the salted prefix
chain sent there, applied to every other router's affinity index as if routed there) and its
own per-replica load (`ReplicaLoad`). `PeerLoads` keeps the latest load of each peer and sums
the fresh ones, so the bounded-load rule and the cost model see the fleet's in-flight work,
not one gateway's share. A peer not heard from for ``stale_after_s`` ages out with all its
load: it stopped, crashed, or the channel between us is down. Time is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["ZERO", "PeerLoads", "ReplicaLoad", "RouteRecord"]


@dataclass(slots=True)
class ReplicaLoad:
    """One gateway's own load on one replica. A value: never changed once built (the same
    object sits in a peer's loads and in the sums), but not a frozen dataclass, whose
    ``__init__`` sets each field through ``object.__setattr__``: with sharing on several are
    built per request (peers' decoded loads, settled requests, the sums, a gateway's own),
    and a frozen one costs ~3.7x the time to build here (callgrind, `sync_cost --simulate`:
    the sharing's instructions -2.6 %)."""

    inflight: int = 0  # requests sent and not finished
    prefill: int = 0  # of those, requests still waiting for their first token
    prefill_tokens: int = 0  # their prompt tokens
    pending_work: float = 0.0  # predicted uncached prefill tokens ahead (the cost model's)

    def __bool__(self) -> bool:
        return bool(self.inflight or self.prefill or self.prefill_tokens or self.pending_work)

    def __add__(self, other: ReplicaLoad) -> ReplicaLoad:
        return ReplicaLoad(
            self.inflight + other.inflight,
            self.prefill + other.prefill,
            self.prefill_tokens + other.prefill_tokens,
            self.pending_work + other.pending_work,
        )


ZERO = ReplicaLoad()


class RouteRecord(NamedTuple):
    """A request's prefix chain was sent to ``replica`` (``tail_blocks`` as in the index).
    (A named tuple: one is made per routed request and per peer's route applied.)"""

    replica: str
    hashes: tuple[int, ...]
    tail_blocks: int = 0


@dataclass(slots=True)
class _Peer:
    seen: float
    loads: dict[str, ReplicaLoad] = field(default_factory=dict)


class PeerLoads:
    """The latest per-replica load of every peer; fresh peers summed per replica.

    The sums are kept up to date per replica as records arrive (a record changes a few
    replicas; `Router.pick` reads the sums on every request), and rebuilt whole only when a
    peer leaves or ages out."""

    def __init__(self, stale_after_s: float) -> None:
        if stale_after_s <= 0:
            raise ValueError("peer stale_after_s must be > 0")
        self.stale_after_s = stale_after_s
        self._peers: dict[str, _Peer] = {}
        self._totals: dict[str, ReplicaLoad] = {}
        self._changed: set[str] = set()  # replicas whose sum is out of date
        self._all_changed = False  # every sum is
        self._next_expiry = float("inf")
        self._ids: tuple[str, ...] | None = None  # sorted live member ids (cached)

    def heard(self, member: str, now: float) -> None:
        """``member`` published something (a route-only batch proves it alive too)."""
        peer = self._peers.get(member)
        if peer is None:
            self._peers[member] = _Peer(now)
            self._ids = None
        else:
            peer.seen = max(peer.seen, now)
        self._next_expiry = min(self._next_expiry, now + self.stale_after_s)

    def apply(
        self, member: str, loads: Mapping[str, ReplicaLoad], now: float
    ) -> list[tuple[str, float]]:
        """``member``'s load changed on the replicas in ``loads`` (others keep their value).
        Returns the replicas where its pending work grew, and by how much (it sent more)."""
        self.heard(member, now)
        own = self._peers[member].loads
        changed = self._changed
        grew: list[tuple[str, float]] = []
        for replica, load in loads.items():
            before = own.get(replica)
            more = load.pending_work - (before.pending_work if before is not None else 0.0)
            if more > 0.0:
                grew.append((replica, more))
            if load:
                own[replica] = load
            elif before is None:
                continue
            else:
                del own[replica]
            changed.add(replica)
        return grew

    def settle(
        self, member: str, replica: str, tokens: int = 0, block: int = 0,
        work: float | None = None,
    ) -> None:
        """One of ``member``'s requests on ``replica`` is known to have finished (ahead of
        the member's own record saying so, which then replaces this guess); ``tokens``: its
        prompt's size, within ``block`` tokens (0: unknown); ``work``: its predicted
        uncached prefill (the blocks its route brought the replica; None: unknown).

        While every request the member counts there still awaits its first token (a
        non-streamed answer's first token is heard with its end), the finished one is among
        them only if their prompt tokens can hold it: one request in flight of another size
        is another request (a long prompt still in prefill: settling it took its pending
        work off the replica), and of several only its own work is taken off (unknown: its
        share of their prompt tokens; a cached 16k-token turn beside a cold 2k prompt took
        ~90 % of the cold prompt's work with it)."""
        peer = self._peers.get(member)
        load = peer.loads.get(replica) if peer is not None else None
        if peer is None or load is None or load.inflight <= 0:
            return
        if load.prefill < load.inflight:
            fewer = ReplicaLoad(load.inflight - 1, load.prefill, load.prefill_tokens,
                                load.pending_work)
        elif tokens <= 0:
            return
        elif load.inflight == 1:
            if abs(load.prefill_tokens - tokens) > block:
                return
            fewer = ZERO
        else:
            if load.prefill_tokens + block < tokens:
                return
            rest = max(0, load.prefill_tokens - tokens)
            if work is None:
                share = rest / load.prefill_tokens if load.prefill_tokens > 0 else 0.0
                left = load.pending_work * share
            else:
                left = max(0.0, load.pending_work - work)
            fewer = ReplicaLoad(load.inflight - 1, load.prefill - 1, rest, left)
        if fewer:
            peer.loads[replica] = fewer
        else:
            del peer.loads[replica]
        self._changed.add(replica)

    def drop(self, member: str) -> None:
        """``member`` said goodbye (a clean shutdown): its load is gone now."""
        if self._peers.pop(member, None) is not None:
            self._all_changed = True
            self._ids = None

    def expire(self, now: float) -> None:
        if now < self._next_expiry:
            return
        limit = now - self.stale_after_s
        gone = [m for m, p in self._peers.items() if p.seen < limit]
        for member in gone:
            self._ids = None
            if self._peers.pop(member).loads:
                self._all_changed = True
        self._next_expiry = min((p.seen for p in self._peers.values()), default=float("inf"))
        self._next_expiry += self.stale_after_s

    def totals(self, now: float) -> Mapping[str, ReplicaLoad]:
        """Per replica, the summed load of every fresh peer (replicas with none omitted).
        The mapping returned is not changed afterwards (a new one replaces it)."""
        self.expire(now)
        if self._all_changed:
            self._all_changed = False
            self._changed.clear()
            totals: dict[str, ReplicaLoad] = {}
            for peer in self._peers.values():
                for replica, load in peer.loads.items():
                    have = totals.get(replica)
                    totals[replica] = load if have is None else have + load
            self._totals = totals
        elif self._changed:
            totals = dict(self._totals)
            peers = self._peers.values()
            for replica in self._changed:
                total: ReplicaLoad | None = None
                for peer in peers:
                    found = peer.loads.get(replica)
                    if found is not None:
                        total = found if total is None else total + found
                if total is None:
                    totals.pop(replica, None)
                else:
                    totals[replica] = total
            self._changed.clear()
            self._totals = totals
        return self._totals

    def members(self, now: float) -> int:
        """Peers heard from within the staleness bound."""
        self.expire(now)
        return len(self._peers)

    def member_ids(self, now: float) -> tuple[str, ...]:
        """The live peers' ids, sorted."""
        self.expire(now)
        if self._ids is None:
            self._ids = tuple(sorted(self._peers))
        return self._ids

    def forget_replica(self, replica: str) -> None:
        for peer in self._peers.values():
            if peer.loads.pop(replica, None) is not None:
                self._changed.add(replica)
