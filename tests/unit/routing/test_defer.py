"""Deferred picks (`Router.defer_s`): in a burst (a pick of its own or a peer's route within the
sync window), a gateway ranked r among N holds a pick among several near-equal candidates r
windows, so that the lower ranks' picks of the same instant reach it first, when the collisions
it may spare outweigh the hold (`routing.holds`); one gateway, rank 0, a pick outside a burst
and a pick for its prefix's holder never wait."""

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


def _in_a_burst(router: Router, now: float, routes: int = 16) -> None:
    """The lowest rank's routes (of other prompts, two per replica) applied within the window:
    picks of the same instant are being made elsewhere, many (16 routes: 4 per window over
    `routing.holds.RATE_WINDOWS`, 4 x 128 ms of a prior mean request / 8 candidates = 64 ms
    of collisions, more than rank 3's 30 ms hold)."""
    router.apply_peer_routes([RouteRecord(IDS[i % len(IDS)], (777_777 + i,), 0)
                              for i in range(routes)], "a", now - WINDOW / 2)


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


@pytest.mark.parametrize(("routes", "own", "mean_tokens", "held"), [
    # one route of the lowest rank within the window (requests arriving one by one): 1/4 of a
    # pick expected per window x 128 ms (a prior mean request, 1,024 tokens at 8,000/s) / 8
    # candidates = 4 ms of collisions, against 30 ms of hold
    (1, 0, 1_024.0, False),
    (16, 0, 1_024.0, True),  # a burst of theirs: 4 per window, 64 ms
    (1, 2, 1_024.0, True),  # two picks of its own within the window: each lower rank as many
    (1, 0, 16_384.0, True),  # long prompts: a collision costs 2 s, 1/4 x 2 s / 8 = 64 ms
])
def test_rank_3_holds_a_contested_pick_only_when_collisions_would_cost_more_than_the_hold(
    routes: int, own: int, mean_tokens: float, held: bool,
) -> None:
    routers = [Router(RouterConfig(prior_request_tokens=mean_tokens)) for _ in NAMES]
    for name, router in zip(NAMES, routers, strict=True):
        router.enable_sharing(2.0, name, WINDOW, True)
        for other in NAMES.replace(name, ""):
            router.apply_peer_load(other, {}, 0.0)
    router = routers[3]
    _in_a_burst(router, 1.0, routes)
    for i in range(own):
        f = _features(10_000 * (i + 1), blocks=4)
        router.record_route(router.pick(f, _views(), 1.0 - WINDOW / 4).replica, f,
                            1.0 - WINDOW / 4)
    wait = router.defer_s(_features(1), _views(), 1.0)
    assert wait == (pytest.approx(3 * WINDOW, rel=0.01) if held else 0.0)


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


def test_the_hold_is_rank_x_the_hold_window_and_a_burst_lasts_the_sync_window() -> None:
    """Records of the picks peers hold for arrive a hold window late (published and read at
    once), the others a sync window late (batched): rank r holds r hold windows, and a
    peer's route applied after the hold window but within the sync window still makes a
    burst."""
    hold = WINDOW / 4
    routers = [Router(RouterConfig()) for _ in range(4)]
    for name, router in zip(NAMES, routers, strict=True):
        router.enable_sharing(2.0, name, WINDOW, True, hold)
        for other in NAMES.replace(name, ""):
            router.apply_peer_load(other, {}, 0.0)
        _in_a_burst(router, 1.0)
    waits = [router.defer_s(_features(1), _views(), 1.0) for router in routers]
    assert waits == pytest.approx([0.0, hold, 2 * hold, 3 * hold], rel=0.01)
    # never more than the sync window
    router = Router(RouterConfig())
    router.enable_sharing(2.0, "b", WINDOW, True, 5 * WINDOW)
    router.apply_peer_load("a", {}, 0.0)
    _in_a_burst(router, 1.0)
    assert router.defer_s(_features(1), _views(), 1.0) == pytest.approx(WINDOW, rel=0.01)


def _urgent_routes(router: Router, picks: list[tuple[RequestFeatures, bool]]) -> list[bool]:
    """For each (request, held) picked and routed in turn at 1.0, whether its route asked to
    go out at once (`Router.on_urgent`)."""
    out: list[bool] = []
    for f, held in picks:
        calls: list[int] = []
        router.on_urgent = lambda calls=calls: calls.append(1)
        decision = router.pick(f, _views(), 1.0, held=held)
        router.record_route(decision.replica, f, 1.0)
        out.append(bool(calls))
    return out


def test_a_contested_pick_a_higher_rank_may_hold_for_goes_out_at_once() -> None:
    """Rank 2 of 4: a cold pick on an idle fleet (contested: it takes a turn) and a held one
    are urgent; a conversation's next turn on its holder is not (one candidate, no turn)."""
    router = _fleet(4)[2]
    cold, held = _features(1), _features(5_000)
    nxt = _features(1, blocks=48)  # `cold`'s chain grown: its holder wins outright
    assert _urgent_routes(router, [(cold, False), (held, True), (nxt, False)]) == [
        True, True, False]


@pytest.mark.parametrize("who", ["top rank", "no defer", "alone"])
def test_nobody_holds_for_the_top_rank_nor_without_held_picks(who: str) -> None:
    if who == "top rank":  # rank 3 of 4: no gateway ranks above it
        router = _fleet(4)[3]
    elif who == "no defer":  # nobody holds picks: nothing to hurry for
        router = _fleet(4, defer=False)[0]
    else:
        router = _fleet(1)[0]
    assert _urgent_routes(router, [(_features(1), False), (_features(5_000), True)]) == [
        False, False]


def test_holding_tells_the_caller_until_when() -> None:
    router = _fleet(2)[1]
    calls: list[float] = []
    router.on_hold = lambda: calls.append(router.held_until)
    router.holding(1.5)
    router.holding(1.2)  # an earlier end does not shorten the one held longer
    assert calls == [1.5, 1.5] and router.held_until == 1.5
