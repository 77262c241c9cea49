"""Which replicas each peer holds a load on in this process's view, so that a peer's whole
load (a heartbeat: `records.Batch.whole`) can replace what is held of it, not only update it.

Peers send a replica's zero once, when their load there ends. A reader that never got that
record -- the stream wiped (`FLUSHALL`, Redis restarted without persistence, the stream
evicted) after the peer wrote it and before this process read it -- kept the peer's finished
requests in its view for as long as the peer lived: its heartbeats carry its non-zero loads
only, so nothing ever said zero again. The routing core's `PeerLoads` merges the loads it is
given, so the replicas a whole load leaves out are handed to it as zeros.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from routing.peers import ZERO, ReplicaLoad

__all__ = ["PeerReplicas"]


class PeerReplicas:
    def __init__(self) -> None:
        self._held: dict[str, set[str]] = {}  # member -> replicas with a non-zero load of it

    def complete(self, member: str, loads: Mapping[str, ReplicaLoad],
                 whole: bool) -> Mapping[str, ReplicaLoad]:
        """``loads`` as the peer's record to apply: with a zero added for every replica held
        of it that a whole load leaves out. Records what will be held of it afterwards."""
        held = self._held.setdefault(member, set())
        if whole and not held <= loads.keys():
            loads = {**dict.fromkeys(held - loads.keys(), ZERO), **loads}
        for replica, load in loads.items():
            if load:
                held.add(replica)
            else:
                held.discard(replica)
        return loads

    def drop(self, member: str) -> None:
        """The peer said goodbye: nothing of it is held."""
        self._held.pop(member, None)

    def keep_only(self, live: Collection[str]) -> None:
        """Forget the peers not among ``live`` (aged out: a process gone for good, whose
        entries would otherwise stay here for as long as this process lives)."""
        for member in [m for m in self._held if m not in live]:
            del self._held[member]

    def __len__(self) -> int:
        return len(self._held)
