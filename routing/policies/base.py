"""What every policy receives and returns: a `PickContext` in, a `Decision` out."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from routing.config import RouterConfig
from routing.index import AffinityIndex
from routing.learning import TtftModel
from routing.peers import ReplicaLoad
from routing.pending import PendingWork
from routing.types import Candidate, Decision, ReplicaView, RequestFeatures

__all__ = ["PickContext", "Policy", "RouterState", "decide"]


@dataclass(frozen=True, slots=True)
class RouterState:
    """The router's learned state, shared by the policies (owned by `Router`)."""

    config: RouterConfig
    index: AffinityIndex
    ttft: TtftModel
    pending: PendingWork
    replica_hashes: dict[str, int]


# a peer's route applied at ``now``: ``chain[held:]`` was new to the replica, ``work`` prompt
# tokens the replica computes for it (published undrained in the peer's load until its first
# token)
PeerComputing = tuple[float, tuple[int, ...], int, float]


# Not frozen, though no policy changes it: one is built per pick (and per `Router.defer_s`),
# and a frozen dataclass's ``__init__`` sets each of its twelve fields through
# ``object.__setattr__`` (~10x the time of plain slot stores here, a tenth of a small pick).
@dataclass(slots=True)
class PickContext:
    features: RequestFeatures
    views: Sequence[ReplicaView]  # healthy candidates, sorted by id
    now: float
    state: RouterState
    explain: bool = False
    # several gateways sharing state: this gateway's rank among the `gateways` live ones; this
    # pick's turn among the picks all of them make within the sync window (which they cannot
    # see of each other), and a function giving the replica order they agree on to take turns
    # in (`Turns.turn`; None with one gateway)
    rank: int = 0
    gateways: int = 1
    turn: int = 0
    turn_order: Callable[[], tuple[str, ...]] | None = None
    # other gateways' load per replica, not added to `views`: given to a policy that reads it
    # beside them (``reads_peer_loads = True``; each pick would otherwise rebuild the views
    # with it), empty otherwise
    peer_loads: Mapping[str, ReplicaLoad] = field(default_factory=dict)
    # per replica, the peers' recent routes there that brought new blocks
    # (`Sharing.peer_computing`): (applied at, chain, blocks held before, new prompt tokens)
    peer_computing: Mapping[str, Sequence[PeerComputing]] = field(default_factory=dict)
    # the silent replicas left out of `views` (`RouterConfig.silent_min_s`): their in-flight
    # requests (fleet-wide) and their number, which the load bound still counts (leaving them
    # out of its mean too would let the rest take every request of a burst)
    left_out: tuple[int, int] = (0, 0)

    @property
    def tie_key(self) -> int:
        f = self.features
        if f.prefix_key:
            return f.prefix_key
        return f.block_hashes[-1] if f.block_hashes else 0


class Policy(Protocol):
    name: str

    def choose(self, ctx: PickContext) -> Decision: ...


def decide(order: Sequence[str], reason: str, ranked: tuple[Candidate, ...] = ()) -> Decision:
    return Decision(replica=order[0], fallbacks=tuple(order[1:]), reason=reason, ranked=ranked)
