"""A request whose chain equals a peer's routed chain does not settle the peer's request
(`Sharing._settle_continued`): past the hash cap every question on one long document hashes
to the same chain, and the peer's question is still in flight on the document's holder."""

from __future__ import annotations

from routing.peers import ReplicaLoad, RouteRecord
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

CFG = RouterConfig(load_factor=1.25, load_slack=1.0)  # a bound that binds at small loads
TPB, CAP = CFG.tokens_per_block, CFG.max_blocks
DOC = tuple(range(100, 100 + CAP))  # a document's first blocks: the hashed cap


def _features(hashes: tuple[int, ...], tokens: int) -> RequestFeatures:
    return RequestFeatures(model="m", block_hashes=hashes, prompt_tokens=tokens,
                           prefix_key=tokens)


def _views() -> list[ReplicaView]:
    return [ReplicaView(id=r, pool="p") for r in ("a", "b", "c")]


def test_another_question_on_a_capped_document_does_not_settle_the_peers() -> None:
    router = Router(CFG)
    router.enable_sharing(2.0, "b")
    # peer 'a' sent a question on a 40k-token document to replica a; it is decoding there
    router.apply_peer_routes([RouteRecord("a", DOC, 40_000 // TPB - CAP)], "a", 0.0)
    router.apply_peer_load("a", {"a": ReplicaLoad(1, 0, 0, 0.0)}, 0.0)
    router.pick(_features(DOC, 40_100), _views(), 0.05)  # another question, same chain
    assert router.peers is not None
    assert router.peers.totals(0.05)["a"] == ReplicaLoad(1, 0, 0, 0.0)


def test_a_turn_extending_the_peers_chain_still_settles_it() -> None:
    router = Router(CFG)
    router.enable_sharing(2.0, "b")
    chain = tuple(range(7, 47))
    router.apply_peer_routes([RouteRecord("a", chain, 0)], "a", 0.0)
    router.apply_peer_load("a", {"a": ReplicaLoad(1, 0, 0, 0.0)}, 0.0)
    decision = router.pick(_features((*chain, 5), TPB * 41 + 10), _views(), 0.1)
    assert decision.replica == "a"
    assert router.peers is not None and "a" not in router.peers.totals(0.1)
