"""`PeerReplicas`: a peer's whole load (a heartbeat) replaces what is held of it."""

from __future__ import annotations

from gateway.fleet.peer_replicas import PeerReplicas
from routing.peers import ZERO, ReplicaLoad

ONE = ReplicaLoad(1, 0, 10, 0.0)


def test_a_whole_load_zeroes_the_replicas_it_leaves_out() -> None:
    held = PeerReplicas()
    assert held.complete("p", {"a": ONE, "b": ONE}, whole=False) == {"a": ONE, "b": ONE}
    # the zero record of "a" was lost: the next heartbeat carries "b" only
    assert held.complete("p", {"b": ONE}, whole=True) == {"a": ZERO, "b": ONE}
    assert held.complete("p", {"b": ONE}, whole=True) == {"b": ONE}  # "a" is not held now


def test_a_change_leaves_the_other_replicas_as_they_are() -> None:
    held = PeerReplicas()
    held.complete("p", {"a": ONE, "b": ONE}, whole=False)
    assert held.complete("p", {"b": ZERO}, whole=False) == {"b": ZERO}
    assert held.complete("p", {}, whole=True) == {"a": ZERO}


def test_peers_are_apart_and_forgotten() -> None:
    held = PeerReplicas()
    held.complete("p", {"a": ONE}, whole=False)
    held.complete("q", {"a": ONE}, whole=False)
    assert held.complete("q", {}, whole=True) == {"a": ZERO}
    held.drop("p")
    assert held.complete("p", {}, whole=True) == {}
    held.keep_only(["p"])
    assert len(held) == 1
