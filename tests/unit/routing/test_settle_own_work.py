"""A continued chain settles a peer's request with that request's own pending prefill work,
not a share of the work in proportion to prompt tokens (`PeerLoads.settle`)."""

from __future__ import annotations

from routing.peers import PeerLoads, ReplicaLoad, RouteRecord
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

TPB = RouterConfig().tokens_per_block


def _features(hashes: tuple[int, ...]) -> RequestFeatures:
    return RequestFeatures(model="m", block_hashes=hashes,
                           prompt_tokens=TPB * len(hashes) + 10, prefix_key=hashes[-1])


def _views() -> list[ReplicaView]:
    return [ReplicaView(id=r, pool="p") for r in ("a", "b", "c")]


def test_settling_a_cached_turn_leaves_the_cold_prompts_work() -> None:
    """Peer 'a' has two requests in prefill on replica a: a 16k-token turn whose history
    replica a holds (a few blocks new) and a cold 2k-token prompt. When this gateway's next
    turn continues the first one's chain, what is left on replica a is the cold prompt's
    ~2k tokens of work, not ~2/18 of the sum (as a share of prompt tokens: ~250)."""
    router = Router(RouterConfig())
    router.enable_sharing(2.0, "b")
    history = tuple(range(10_000, 10_000 + 16_000 // TPB - 4))
    router.apply_peer_routes([RouteRecord("a", history, 0)], "a", 0.0)  # an earlier turn
    turn = (*history, 1, 2, 3, 4)  # its next turn: 4 blocks new to replica a
    cold = tuple(range(50_000, 50_000 + 2_000 // TPB))
    router.apply_peer_routes([RouteRecord("a", turn, 0), RouteRecord("a", cold, 0)], "a", 1.0)
    own = 4.0 * TPB  # the turn's own work
    cold_work = float(len(cold) * TPB)
    router.apply_peer_load(
        "a", {"a": ReplicaLoad(2, 2, len(turn) * TPB + len(cold) * TPB, own + cold_work)}, 1.0)
    router.pick(_features((*turn, 5, 6)), _views(), 1.1)  # the turn after: its end is known
    assert router.peers is not None
    left = router.peers.totals(1.1)["a"]
    assert (left.inflight, left.prefill, left.prefill_tokens) == (1, 1, len(cold) * TPB)
    assert left.pending_work == cold_work


def test_settle_takes_off_the_work_given_and_no_more_than_is_left() -> None:
    peers = PeerLoads(2.0)
    peers.apply("a", {"r": ReplicaLoad(2, 2, 18_000, 2_256.0)}, 0.0)
    peers.settle("a", "r", 16_000, 64, 256.0)
    assert peers.totals(0.1)["r"] == ReplicaLoad(1, 1, 2_000, 2_000.0)
    peers.apply("a", {"r": ReplicaLoad(2, 2, 4_000, 500.0)}, 0.2)
    peers.settle("a", "r", 2_000, 64, 900.0)  # predicted more than is left: none left
    assert peers.totals(0.3)["r"] == ReplicaLoad(1, 1, 2_000, 0.0)
