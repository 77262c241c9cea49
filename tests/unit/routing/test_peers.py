"""Shared routing state in the pure core: peers' loads summed and aged out, peers' routes in
the affinity index, the outbox, and a continued conversation settling a peer's request."""

from __future__ import annotations

import dataclasses
import random

import pytest

from routing.peers import PeerLoads, ReplicaLoad, RouteRecord
from routing.router import Router, RouterConfig
from routing.types import ReplicaView, RequestFeatures

L1 = ReplicaLoad(1, 1, 100, 80.0)
L2 = ReplicaLoad(2, 0, 0, 0.0)


@pytest.mark.parametrize(("events", "now", "expected"), [
    ([("a", {"r": L1}, 0.0)], 0.5, {"r": L1}),
    ([("a", {"r": L1}, 0.0), ("b", {"r": L2}, 0.1)], 0.5, {"r": L1 + L2}),
    ([("a", {"r": L1}, 0.0), ("a", {"r": L2}, 0.1)], 0.5, {"r": L2}),  # latest wins
    ([("a", {"r": L1}, 0.0), ("a", {"r": ReplicaLoad()}, 0.1)], 0.5, {}),  # back to zero
    ([("a", {"r": L1}, 0.0)], 2.5, {}),  # aged out
    ([("a", {"r": L1}, 0.0), ("a", {}, 2.0)], 2.5, {"r": L1}),  # a heartbeat keeps it
    ([("a", {"r": L1}, 0.0), ("b", {"s": L2}, 2.0)], 2.5, {"s": L2}),  # one ages out
])
def test_peer_loads(
    events: list[tuple[str, dict[str, ReplicaLoad], float]], now: float,
    expected: dict[str, ReplicaLoad],
) -> None:
    peers = PeerLoads(stale_after_s=2.0)
    for member, loads, at in events:
        peers.apply(member, loads, at)
    assert dict(peers.totals(now)) == expected


@pytest.mark.parametrize(("first", "then", "grew"), [
    ({}, {"r": L1}, [("r", 80.0)]),  # new work
    ({"r": L1}, {"r": ReplicaLoad(2, 2, 300, 200.0)}, [("r", 120.0)]),  # more
    ({"r": L1}, {"r": L2}, []),  # its first token came: less
    ({"r": L1}, {"r": ReplicaLoad()}, []),  # none left
    ({"r": L1}, {"s": L1}, [("s", 80.0)]),  # r keeps its value
])
def test_apply_says_where_a_peers_pending_work_grew(
    first: dict[str, ReplicaLoad], then: dict[str, ReplicaLoad], grew: list[tuple[str, float]]
) -> None:
    peers = PeerLoads(stale_after_s=2.0)
    peers.apply("a", first, 0.0)
    peers.apply("b", {"r": L1}, 0.0)  # another peer's work there is not the change
    assert peers.apply("a", then, 0.1) == grew


def test_drop_settle_and_members() -> None:
    peers = PeerLoads(2.0)
    peers.apply("a", {"r": ReplicaLoad(2, 1, 50, 40.0)}, 0.0)
    peers.apply("b", {"r": L2}, 0.0)
    assert peers.member_ids(1.0) == ("a", "b")
    peers.settle("a", "r")
    assert peers.totals(1.0)["r"].inflight == 3
    peers.drop("b")
    assert peers.totals(1.0)["r"] == ReplicaLoad(1, 1, 50, 40.0)
    assert peers.members(5.0) == 0


def test_sums_kept_per_replica_match_a_full_recount() -> None:
    """The sums are updated per replica as records arrive; after any mix of records,
    settles, goodbyes, expiries and forgotten replicas they equal a recount from scratch,
    and a mapping handed out earlier is never changed afterwards."""
    rng = random.Random(3)
    peers = PeerLoads(stale_after_s=1.0)
    members, replicas = ["a", "b", "c"], ["r0", "r1", "r2", "r3"]
    now = 0.0
    for _ in range(3000):
        now += rng.random() * 0.05
        before = peers.totals(now)
        frozen = dict(before)
        kind = rng.random()
        member, replica = rng.choice(members), rng.choice(replicas)
        if kind < 0.6:
            peers.apply(member, {r: ReplicaLoad(rng.randrange(3), rng.randrange(2),
                                                rng.randrange(3) * 64, rng.randrange(3) * 8.0)
                                 for r in rng.sample(replicas, rng.randrange(3))}, now)
        elif kind < 0.85:
            peers.settle(member, replica)
        elif kind < 0.9:
            peers.drop(member)
        elif kind < 0.95:
            peers.forget_replica(replica)
        got = dict(peers.totals(now))
        assert dict(before) == frozen
        expected: dict[str, ReplicaLoad] = {}
        for peer in peers._peers.values():
            for r, load in peer.loads.items():
                expected[r] = expected.get(r, ReplicaLoad()) + load
        assert got == expected


def test_stale_bound_must_be_positive() -> None:
    with pytest.raises(ValueError):
        PeerLoads(0.0)


def _views(inflight: dict[str, int] | None = None) -> list[ReplicaView]:
    inflight = inflight or {}
    return [ReplicaView(id=r, pool="p", inflight=inflight.get(r, 0)) for r in ("a", "b", "c")]


def _features(hashes: tuple[int, ...], tokens: int = 0) -> RequestFeatures:
    return RequestFeatures(model="m", block_hashes=hashes,
                           prompt_tokens=tokens or 64 * len(hashes) + 10, prefix_key=hashes[-1])


@pytest.mark.parametrize(("blocks", "window_s"), [(40, 0.0), (40, 0.01), (3, 0.01)])
def test_a_peers_route_attracts_the_next_turn(blocks: int, window_s: float) -> None:
    """Also with a sync window (gateways taking turns) and a prompt so short that every
    replica costs about the same: a turn never takes a conversation off its holder."""
    gw_a, gw_b = Router(RouterConfig()), Router(RouterConfig())
    gw_a.enable_sharing(2.0, "a", window_s)
    gw_b.enable_sharing(2.0, "b", window_s)
    gw_a.apply_peer_load("b", {}, 0.0)  # each knows the other
    gw_b.apply_peer_load("a", {}, 0.0)
    chain = tuple(range(100, 100 + blocks))
    first = gw_a.pick(_features(chain), _views(), 0.0)
    gw_a.record_route(first.replica, _features(chain), 0.0)
    outbox = gw_a.drain_outbox()
    assert outbox == [RouteRecord(first.replica, chain, 0)] and gw_a.drain_outbox() == []
    gw_b.apply_peer_routes(outbox, "a", 0.05)
    for t in range(4):  # the following turns, whichever gateway has its turn
        nxt = gw_b.pick(_features((*chain, 999 + t)), _views(), 0.1 + 0.001 * t)
        assert (nxt.replica, nxt.reason) == (first.replica, "prefix-hit")
        gw_b.record_route(nxt.replica, _features((*chain, 999 + t)), 0.1 + 0.001 * t)
    assert gw_b.peer_decisions >= 1


TIGHT = RouterConfig(load_factor=1.25, load_slack=1.0)  # a bound that binds at small loads


def test_peers_in_flight_load_counts_in_the_load_bound() -> None:
    router = Router(TIGHT)
    router.enable_sharing(2.0, "b")
    chain = tuple(range(7, 47))
    router.apply_peer_routes([RouteRecord("a", chain, 0)], "a", 0.0)
    # the holder of the prefix has 6 requests of peer 'a' in flight: over the bound
    router.apply_peer_load("a", {"a": ReplicaLoad(6, 0, 0, 0.0)}, 0.0)
    other = tuple(range(1000, 1040))  # a different conversation: it must not settle them
    assert router.pick(_features(other), _views(), 0.1).replica != "a"
    decision = router.pick(_features(chain[:30]), _views(), 0.1)
    assert decision.replica != "a" and decision.reason == "overflow"


def test_a_continued_chain_settles_the_peers_finished_request() -> None:
    router = Router(TIGHT)
    router.enable_sharing(2.0, "b")
    chain = tuple(range(7, 47))
    router.apply_peer_routes([RouteRecord("a", chain, 0)], "a", 0.0)
    # peer 'a' still says 1 in flight on replica a: the previous turn, whose 'finished'
    # record is on its way (over the bound of an otherwise idle pool: it would overflow)
    router.apply_peer_load("a", {"a": ReplicaLoad(1, 0, 0, 0.0)}, 0.0)
    decision = router.pick(_features((*chain, 5, 6)), _views(), 0.1)
    assert decision.replica == "a" and decision.reason == "prefix-hit"
    assert router.peers is not None and "a" not in router.peers.totals(0.1)


def test_a_continued_chain_does_not_settle_a_peers_request_still_in_prefill() -> None:
    """The peer's record of the previous turn's end came long ago; since then the peer sent
    a long prompt to the same replica, still in prefill. A next turn on the old chain must
    not take that prompt's pending work off the replica (the continued request had its
    answer: it is not one of the peer's requests awaiting a first token). Four gateways on
    giant-sessions sent chat turns behind a peer's 100k-token prefill (TTFT 2-4 s)."""
    router = Router(TIGHT)
    router.enable_sharing(2.0, "b")
    chain = tuple(range(7, 47))
    router.apply_peer_routes([RouteRecord("a", chain, 0)], "a", 0.0)
    router.apply_peer_load("a", {"a": ReplicaLoad(1, 0, 0, 0.0)}, 0.0)
    router.apply_peer_load("a", {"a": ReplicaLoad()}, 5.0)  # the turn's end, heard
    giant = tuple(range(5000, 5256))
    router.apply_peer_routes([RouteRecord("a", giant, 1500)], "a", 30.0)
    busy = ReplicaLoad(1, 1, 112_000, 112_000.0)
    router.apply_peer_load("a", {"a": busy}, 30.0)
    decision = router.pick(_features((*chain, 5, 6)), _views(), 30.5)
    assert router.peers is not None and router.peers.totals(30.5)["a"] == busy
    assert decision.replica != "a"  # not behind 112k tokens of prefill for 40 blocks


def test_a_continued_chain_settles_a_peers_non_streamed_request() -> None:
    """A non-streamed answer's first token is heard with its end: while that end is on its
    way the peer still counts the previous turn as awaiting its first token. A next turn on
    its chain settles it (a request of the chain's size), as for a streamed one."""
    router = Router(TIGHT)
    router.enable_sharing(2.0, "b")
    chain = tuple(range(7, 47))  # 40 blocks of 64 tokens
    router.apply_peer_routes([RouteRecord("a", chain, 0)], "a", 0.0)
    router.apply_peer_load("a", {"a": ReplicaLoad(1, 1, 40 * 64 + 30, 300.0)}, 0.0)
    decision = router.pick(_features((*chain, 5, 6)), _views(), 0.1)
    assert decision.replica == "a" and decision.reason == "prefix-hit"
    assert router.peers is not None and "a" not in router.peers.totals(0.1)


def test_settling_one_of_several_requests_in_prefill_takes_its_share() -> None:
    peers = PeerLoads(2.0)
    peers.apply("a", {"r": ReplicaLoad(3, 3, 12_000, 6_000.0)}, 0.0)
    peers.settle("a", "r", 3_000, 64)
    assert peers.totals(0.1)["r"] == ReplicaLoad(2, 2, 9_000, 4_500.0)
    peers.settle("a", "r", 20_000, 64)  # larger than all they wait for: not one of them
    peers.settle("a", "r")  # of unknown size: nothing
    assert peers.totals(0.1)["r"] == ReplicaLoad(2, 2, 9_000, 4_500.0)


def test_without_sharing_there_is_no_outbox() -> None:
    router = Router(RouterConfig())
    router.record_route("a", _features((1, 2, 3)), 0.0)
    assert router.drain_outbox() == []


@pytest.mark.parametrize(("window_s", "distinct"), [(0.01, 8), (0.0, 7)])
def test_gateways_blind_to_each_others_burst_take_turns(window_s: float, distinct: int) -> None:
    """Two gateways, eight idle replicas, four cold requests each at one instant, before any
    record of the other's arrives: with a sync window they take turns (no two on a replica);
    without one, ties go by each request's hash and two requests of the burst collide."""
    ids = [f"r{i}" for i in range(8)]
    gateways = [Router(RouterConfig()) for _ in range(2)]
    for name, router in zip("ab", gateways, strict=True):
        router.enable_sharing(2.0, name, window_s)
    for name, router in zip("ab", gateways, strict=True):
        router.apply_peer_load("b" if name == "a" else "a", {}, 0.0)  # each knows the other
    picks: list[tuple[int, str]] = []
    for i in range(4):
        for g, router in enumerate(gateways):
            counts = {rid: 0 for rid in ids}
            for _, rid in (p for p in picks if p[0] == g):
                counts[rid] += 1  # its own in flight (the other's unseen)
            views = [ReplicaView(id=rid, pool="p", inflight=counts[rid]) for rid in ids]
            f = _features(tuple(range(10_000 * (2 * i + g) + 1, 10_000 * (2 * i + g) + 40)))
            decision = router.pick(f, views, 1.0)
            assert decision.reason != "overflow"  # a turn is no overflow: nothing is full
            router.record_route(decision.replica, f, 1.0)
            picks.append((g, decision.replica))
    assert len({replica for _, replica in picks}) == distinct, picks


@pytest.mark.parametrize(("window_s", "distinct"), [(0.01, 8), (0.0, 5)])
def test_four_gateways_spread_a_burst_they_cannot_see(window_s: float, distinct: int) -> None:
    """Issue 9's setting: four gateways, eight idle replicas, a burst of eight cold requests of
    one size (two per gateway, arriving in turn) before any record of the burst arrives. With a
    sync window their turns put the burst on eight replicas; without one each gateway sees an
    idle fleet and ties go by each request's hash, so requests collide."""
    ids = [f"r{i}" for i in range(8)]
    names = "abcd"
    gateways = [Router(RouterConfig()) for _ in names]
    for name, router in zip(names, gateways, strict=True):
        router.enable_sharing(2.0, name, window_s)
        for other in names.replace(name, ""):
            router.apply_peer_load(other, {}, 0.0)  # each knows the others
    picks: list[tuple[int, str]] = []
    for i in range(2):
        for g, router in enumerate(gateways):
            own = [rid for h, rid in picks if h == g]  # its own in flight (the others' unseen)
            views = [ReplicaView(id=rid, pool="p", inflight=own.count(rid)) for rid in ids]
            start = 10_000 * (len(names) * i + g) + 1
            f = _features(tuple(range(start, start + 40)))
            replica = router.pick(f, views, 1.0).replica
            router.record_route(replica, f, 1.0)
            picks.append((g, replica))
    assert len({replica for _, replica in picks}) == distinct, picks


def test_peers_load_beside_the_views_decides_as_views_carrying_it() -> None:
    """`cache_aware` reads other gateways' load beside the views (`PickContext.peer_loads`);
    its decisions and explained terms equal those of a router given views with that load
    added (no sharing), whatever the loads, scrapes and cached prefixes, at the instant the
    load is applied (later, ours drains behind the peers' work, `PendingWork.arrived`: views
    carry no times)."""
    rng = random.Random(11)
    ids = [f"r{i}" for i in range(6)]
    for _ in range(40):
        shared, plain = Router(RouterConfig()), Router(RouterConfig())
        shared.enable_sharing(2.0, "me")
        # plain: a peer too (ties are broken as with several gateways), one that carries no load
        plain.enable_sharing(2.0, "me")
        plain.apply_peer_load("peer", {}, 0.0)
        chains = [tuple(rng.getrandbits(40) for _ in range(rng.randrange(2, 30)))
                  for _ in range(8)]
        for chain in chains:
            replica = rng.choice(ids)
            for router in (shared, plain):
                router.record_route(replica, _features(chain), 0.0)
        loads = {rid: ReplicaLoad(rng.randrange(8), rng.randrange(3), rng.randrange(4) * 900,
                                  rng.randrange(4) * 700.0)
                 for rid in rng.sample(ids, rng.randrange(len(ids) + 1))}
        shared.apply_peer_load("peer", loads, 0.0)
        own = [ReplicaView(id=rid, pool="p", inflight=rng.randrange(5),
                           inflight_prefill_tokens=rng.randrange(3) * 640,
                           inflight_prefill=rng.randrange(2),
                           waiting=rng.choice([None, 0.0, 3.0]), running=rng.choice([None, 4.0]),
                           kv_usage=rng.random(), scrape_age_s=rng.choice([None, 0.1, 9.0]))
               for rid in ids]
        merged = [v if (p := loads.get(v.id)) is None else dataclasses.replace(
            v, inflight=v.inflight + p.inflight,
            inflight_prefill_tokens=v.inflight_prefill_tokens + p.prefill_tokens,
            inflight_prefill=v.inflight_prefill + p.prefill,
            peer_prefill_work=v.peer_prefill_work + p.pending_work) for v in own]
        for chain in (*chains, tuple(rng.getrandbits(40) for _ in range(12))):
            f = _features((*chain, rng.getrandbits(40)))
            assert shared.pick(f, own, 0.0, explain=True) == plain.pick(
                f, merged, 0.0, explain=True)


@pytest.mark.parametrize(("gateways", "later_s", "blended"), [
    (4, 0.0, True),  # the gateway's second pick in the window: a burst
    (4, 0.02, False),  # its first pick in a new window
    (1, 0.0, False),  # one gateway sees its own picks: its fits as learned
])
def test_in_a_burst_replica_fits_count_half_way_to_the_fleets(
    gateways: int, later_s: float, blended: bool
) -> None:
    """Gateways blind to each other's picks all lean on the same replica-to-replica fit
    differences (learned from the same scrapes), and stack a burst on the replica that looks
    fastest: from a gateway's second pick within the sync window the fits it costs with are
    half-way to the fleet's; its first pick, and one gateway's every pick, use them as learned."""
    router = Router(RouterConfig())
    if gateways > 1:
        router.enable_sharing(2.0, "a", 0.01)
        for peer in "bcd"[: gateways - 1]:
            router.apply_peer_load(peer, {}, 0.0)
    for work in (500.0, 1000.0, 2000.0, 4000.0, 8000.0, 16000.0):  # r0 fast, r1 slow
        router.state.ttft.observe("r0", work, 0.01 + work / 40_000)
        router.state.ttft.observe("r1", work, 0.05 + work / 10_000)
    views = [ReplicaView(id=r, pool="p") for r in ("r0", "r1")]
    first = _features(tuple(range(1, 30)))
    router.record_route(router.pick(first, views, 1.0).replica, first, 1.0)
    for k in range(2):  # the second time after a new observation (the fits changed)
        ranked = router.pick(_features(tuple(range(100, 130))), views, 1.0 + later_s,
                             explain=True).ranked
        fleet = router.state.ttft.fleet
        for c in ranked:
            own = router.ttft_fit(c.replica)
            spt = (own.s_per_token + fleet.s_per_token) / 2 if blended else own.s_per_token
            fixed = (own.fixed_s + fleet.fixed_s) / 2 if blended else own.fixed_s
            assert c.terms["prefill_tps"] == pytest.approx(1.0 / spt), k
            assert c.terms["fixed_s"] == pytest.approx(fixed), k
        assert router.ttft_fit("r0").rate > 2 * router.ttft_fit("r1").rate  # the fits differ
        router.state.ttft.observe("r0", 3000.0, 0.5)


@pytest.mark.parametrize(("later_s", "other_work", "holder"), [
    (0.0, 0.0, False),  # the peer's prefill just began: a copy elsewhere is cheaper
    (0.5, 0.0, True),  # most of the shared prefix is computed: wait for it on its holder
    (0.5, 20_000.0, False),  # the peer's other pending work there counts in full
])
def test_a_peers_prefill_of_the_shared_prefix_drains(
    later_s: float, other_work: float, holder: bool
) -> None:
    """A peer publishes its pending prefill undrained until the first token. The part a
    request's own prefix waits for (a peer's route brought those blocks to the replica
    recently, and no other replica holds them) drains at the replica's rate since the route
    was applied, so the request goes to the holder instead of copying the prefix."""
    router = Router(RouterConfig())
    router.enable_sharing(2.0, "me", 0.01)
    chain = tuple(range(7, 107))  # 100 blocks, 6,400 new prompt tokens on "a"
    router.apply_peer_routes([RouteRecord("a", chain, 0)], "peer", 0.0)
    router.apply_peer_load("peer", {"a": ReplicaLoad(2, 2, 6400, 6400.0 + other_work)}, 0.0)
    # the same system prompt, another user's turn (not a continuation of the peer's chain)
    decision = router.pick(_features((*chain[:60], 5)), _views(), later_s)
    assert (decision.replica == "a") is holder


@pytest.mark.parametrize(("ours", "expected"), [
    (8000, "b"),  # a: ours behind the peer's, 20,000 left of both; b: 16,000 left
    (0, "a"),  # a: the peer's alone, 12,000 left (counted undrained: 20,000 < 24,000)
])
def test_our_pending_work_waits_behind_the_peers(ours: int, expected: str) -> None:
    """One replica prefills everyone's requests: our own pending work there drains only as
    the whole queue does, the work peers sent there before ours too. Drained at the
    replica's whole rate (as if it prefilled nothing else) while the peers' counted in
    full, each gateway saw its own queues as nearly done and piled onto the replicas
    holding its own backlog (load-ramp at 262,144, four gateways)."""
    router = Router(RouterConfig())
    router.enable_sharing(2.0, "me", 0.0)
    router.apply_peer_load("peer", {"a": ReplicaLoad(1, 1, 20_000, 20_000.0),
                                    "b": ReplicaLoad(1, 1, 24_000, 24_000.0)}, 0.0)
    views = [ReplicaView(id="a", pool="p"), ReplicaView(id="b", pool="p")]
    if ours:
        router.record_route("a", _features(tuple(range(1000, 1125)), ours), 0.0)
        views[0] = ReplicaView(id="a", pool="p", inflight=1, inflight_prefill=1,
                               inflight_prefill_tokens=ours)
    later = 8000.0 / router.prefill_rate("a")  # 8,000 tokens prefilled on each since
    decision = router.pick(_features(tuple(range(3000, 3010))), views, later)
    assert decision.replica == expected


@pytest.mark.parametrize(("waiting", "expected"), [
    (0, "b"),  # the peers' work counted as published: a 30,000 > b 24,000
    (20, "a"),  # the fleet overloaded: a's, sent earlier, has 22,000 left; b's 24,000
])
def test_under_overload_the_peers_pending_work_drains_too(waiting: int, expected: str) -> None:
    """Away from overload the peers' pending work counts as they published it (undrained
    until its first token); while the replicas' scraped queues hold more than a quarter of a
    second of prefill each, every queue the peers feed drains in the cost as ours does: counted
    undrained, the older queues looked longest and each gateway piled onto the replicas
    holding its own backlog (load-ramp at 262,144, four gateways)."""
    router = Router(RouterConfig())
    router.enable_sharing(2.0, "me", 0.0)
    router.apply_peer_load("peer", {"a": ReplicaLoad(1, 1, 30_000, 30_000.0)}, 0.0)
    later = 8000.0 / router.prefill_rate("a")  # 8,000 tokens prefilled on a since
    router.apply_peer_load("peer", {"b": ReplicaLoad(1, 1, 24_000, 24_000.0)}, later)
    views = [ReplicaView(id=r, pool="p", waiting=waiting, scrape_age_s=0.0) for r in "ab"]
    decision = router.pick(_features(tuple(range(3000, 3010))), views, later)
    assert decision.replica == expected


def test_a_request_behind_a_peers_work_waits_for_what_is_left_of_it() -> None:
    """The work predicted ahead of a request (what its first token teaches the TTFT fit)
    counts the peers' pending work there as drained at the replica's rate since it was
    sent, with ours: a queue one gateway sees a quarter of must not look longer than it is,
    nor, drained as ours alone, shorter."""
    router = Router(RouterConfig())
    router.enable_sharing(2.0, "me", 0.0)
    router.apply_peer_load("peer", {"a": ReplicaLoad(1, 1, 8000, 8000.0)}, 0.0)
    rate = router.prefill_rate("a")
    req = _features(tuple(range(1000, 1010)), 640)
    router.record_route("a", req, 2000.0 / rate)
    popped = router.state.pending.pop("a", (req.prefix_key, 640))
    assert popped is not None
    assert popped[0] == pytest.approx(6000.0 + 640.0)  # 8,000 sent, 2,000 done since
    assert popped[1] == 640.0



def test_a_peers_work_on_replicas_that_left_the_pool_is_not_kept_here_for_good() -> None:
    """Other gateways' pending work joins a replica's queue here (`PendingWork.arrived`),
    whichever replica they publish it on: one that left the pool (`forget_replica`) while a
    peer still had requests there too. Such a record, with none of ours pending and nothing
    joining it for the pending TTL, goes (a pool whose replicas are replaced one after
    another kept one record per replica it ever had); one with ours pending stays."""
    router = Router(RouterConfig())
    router.enable_sharing(2.0, "me")
    ttl = router.config.pending_ttl_s
    views = [ReplicaView(id="r0", pool="p")]
    grown = ReplicaLoad(1, 1, 1300, 1200.0)
    records = router.state.pending.records()
    for i in range(20):
        now = i * ttl / 2
        gone = f"old{i}"
        router.apply_peer_load("peer", {gone: grown}, now)  # a peer's request there
        router.forget_replica(gone)  # it left the pool
        router.apply_peer_load("peer", {gone: ReplicaLoad()}, now + 0.1)  # (the peer's ended)
        f = _features(tuple(range(1000 * i + 1, 1000 * i + 21)))
        router.record_route(router.pick(f, views, now + 0.2).replica, f, now + 0.2)
        # a peer that has not heard yet sends there again
        router.apply_peer_load("peer", {gone: grown}, now + 0.3)
        assert gone in records and records["r0"].count >= 1
        # r0 and those joined within two TTLs (swept at most once per TTL): 1 + 5
        assert len(records) <= 6, sorted(records)
    assert "old0" not in records
