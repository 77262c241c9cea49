"""Deferred picks (`Router.defer_s`): in a burst (a pick of its own or a peer's route within the
sync window), a gateway ranked r among N holds a pick among several near-equal candidates r
windows, so that the lower ranks' picks of the same instant reach it first; one gateway, rank
0, a pick outside a burst and a pick for its prefix's holder never wait."""

from __future__ import annotations

import pytest

from routing.peers import ReplicaLoad, RouteRecord
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

WINDOW = 0.01
IDS = [f"r{i}" for i in range(8)]
NAMES = "abcd"  # ranks 0-3 (members sort by id)


def _features(start: int, blocks: int = 40, key: int = 0) -> RequestFeatures:
    hashes = tuple(range(start, start + blocks))
    return RequestFeatures(model="m", block_hashes=hashes, prompt_tokens=64 * blocks + 10,
                           prefix_key=key or hashes[-1])


def _views(inflight: dict[str, int] | None = None) -> list[ReplicaView]:
    inflight = inflight or {}
    return [ReplicaView(id=r, pool="p", inflight=inflight.get(r, 0)) for r in IDS]


def _fleet(n: int, defer: bool = True) -> list[Router]:
    routers = [Router(RouterConfig()) for _ in range(n)]
    for name, router in zip(NAMES, routers, strict=False):
        router.enable_sharing(2.0, name, WINDOW, defer)
        for other in NAMES[:n].replace(name, ""):
            router.apply_peer_load(other, {}, 0.0)  # each knows the others
    return routers


def _in_a_burst(router: Router, now: float) -> None:
    """A peer's route (of another prompt) applied within the window: picks of the same
    instant are being made elsewhere."""
    router.apply_peer_routes([RouteRecord("r7", (777_777,), 0)], "d", now - WINDOW / 2)


def test_in_a_burst_rank_r_holds_a_contested_pick_r_windows_and_rank_0_never() -> None:
    """A cold request on an idle fleet: every replica is as good (a contested pick)."""
    routers = _fleet(4)
    for router in routers:
        _in_a_burst(router, 1.0)
    waits = [router.defer_s(_features(1), _views(), 1.0) for router in routers]
    assert waits[0] == 0.0
    assert waits[1:] == pytest.approx([WINDOW, 2 * WINDOW, 3 * WINDOW], rel=0.01)
    # bounded: never more than N - 1 windows (and a little)
    assert max(waits) <= 3 * WINDOW * 1.01


def test_a_gateways_own_pick_within_the_window_is_a_burst_too() -> None:
    router = _fleet(4)[2]
    assert router.defer_s(_features(1), _views(), 1.0) == 0.0  # nothing within the window
    router.record_route("r0", _features(50_000), 1.0)
    assert router.defer_s(_features(1), _views({"r0": 1}), 1.0 + WINDOW / 2) > 0.0
    assert router.defer_s(_features(1), _views({"r0": 1}), 1.0 + 2 * WINDOW) == 0.0


@pytest.mark.parametrize("sharing", ["off", "alone", "no-defer", "no-window"])
def test_one_gateway_or_a_caller_that_does_not_hold_never_defers(sharing: str) -> None:
    router = Router(RouterConfig())
    if sharing == "alone":  # sharing on, no peer known: one gateway
        router.enable_sharing(2.0, "b", WINDOW, True)
    elif sharing == "no-defer":  # peers, but the caller does not hold picks
        router = _fleet(4, defer=False)[3]
    elif sharing == "no-window":  # records on time: nothing to wait for
        router.enable_sharing(2.0, "b", 0.0, True)
        router.apply_peer_load("a", {}, 0.0)
    if sharing != "off":
        _in_a_burst(router, 1.0)
    assert router.defer_s(_features(1), _views(), 1.0) == 0.0


def test_a_pick_for_its_prefixs_holder_never_defers() -> None:
    """A conversation's next turn, its previous one routed by a peer: it goes to the holder,
    at once, whatever the rank."""
    routers = _fleet(4)
    first = routers[0].pick(_features(1), _views(), 0.0)
    routers[0].record_route(first.replica, _features(1), 0.0)
    records = routers[0].drain_outbox()
    nxt = _features(1, blocks=48)  # the same chain, grown by the answer and a new message
    for router in routers[1:]:
        router.apply_peer_routes(records, "a", 1.995)  # (a burst too)
        assert router.defer_s(nxt, _views(), 2.0) == 0.0
        assert router.pick(nxt, _views(), 2.0).replica == first.replica


def test_a_deferred_pick_sees_the_peers_pick_of_the_same_instant() -> None:
    """Two gateways in a burst, an idle fleet, two long cold prompts arriving one at each at
    one instant. Rank 0 picks at once; rank 1 holds its pick one window, by when rank 0's
    records have arrived, and goes elsewhere than where, picked blind, it would have gone:
    rank 0's replica."""
    a, b = _fleet(2)
    _in_a_burst(b, 1.0)
    fa = _features(1, 200)
    assert a.defer_s(fa, _views(), 1.0) == 0.0
    picked = a.pick(fa, _views(), 1.0).replica
    a.record_route(picked, fa, 1.0)
    # a prompt rank 1 would send there picking blind (the same idle fleet, no turn)
    fb = next(f for f in (_features(100_000, 200, key=k) for k in range(1, 500))
              if _fleet(2)[1].pick(f, _views(), 1.0, held=True).replica == picked)
    wait = b.defer_s(fb, _views(), 1.0)
    assert wait > WINDOW
    # a's records reach b one window after its pick, before b's held pick is made
    b.apply_peer_routes(a.drain_outbox(), "a", 1.0 + WINDOW)
    load = ReplicaLoad(1, 1, fa.prompt_tokens, a.own_load(picked))
    b.apply_peer_load("a", {picked: load}, 1.0 + WINDOW)
    assert b.pick(fb, _views(), 1.0 + wait, held=True).replica != picked
