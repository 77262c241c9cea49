"""Live contexts (`routing.policies.sessions`) and cache_aware's ramp for new contexts."""

from __future__ import annotations

import pytest

from routing.config import RouterConfig
from routing.policies.sessions import Sessions
from routing.router import Router
from routing.types import ReplicaView

from .helpers import feats, views

TOOLS = "tool schema and instructions. " * 120  # the agents' shared prompt, ~14 blocks


def _call(s: Sessions, chain: list[int], replica: str, now: float) -> int | None:
    previous = s.continued(chain, len(chain) - 1)  # the chain's new block is never held
    s.record(chain, replica, now, previous)
    return previous


def test_a_request_ending_its_match_on_an_earlier_tail_continues_it() -> None:
    s = Sessions(window_s=8.0)
    assert _call(s, [1, 2, 3], "r0", 0.0) is None  # matched [1, 2]: no request ended there
    assert _call(s, [1, 2, 3, 4], "r0", 1.0) == 3
    assert s.continued([1, 2, 9], 2) is None  # branches off a shared prefix: a new context
    assert s.continued([], 0) is None
    assert s.continued([1, 2, 3], 7) is None  # a match longer than the chain: no tail named


def test_a_context_is_live_after_two_quick_returns_and_until_the_window_passes() -> None:
    s = Sessions(window_s=8.0)
    chain = [1, 2]
    for t, live in [(0.0, {}), (2.0, {}), (4.0, {"r1": 1}), (7.0, {"r1": 1})]:
        _call(s, chain, "r1", t)
        assert dict(s.live(t)) == live
        chain = [*chain, len(chain) + 1]
    assert dict(s.live(15.0)) == {"r1": 1}
    assert dict(s.live(15.1)) == {}


def test_a_context_moves_with_its_last_request_and_counts_once() -> None:
    s = Sessions(window_s=8.0)
    chain = [1, 2]
    for t, replica in enumerate(["r0", "r0", "r0", "r2", "r2"]):
        _call(s, chain, replica, float(t))
        chain = [*chain, 10 + t]
    assert dict(s.live(5.0)) == {"r2": 1}
    _call(s, chain[:-1], "r1", 5.0)  # the same prompt once more
    assert dict(s.live(5.0)) == {"r1": 1}


def test_slow_returns_never_make_a_context_live() -> None:
    s = Sessions(window_s=8.0)
    chain = [1, 2]
    for k in range(6):
        _call(s, chain, "r0", 10.0 * k)  # a conversation's turns minutes apart
        chain = [*chain, 10 + k]
        assert dict(s.live(10.0 * k)) == {}


def test_tails_are_bounded_oldest_forgotten_first() -> None:
    s = Sessions(window_s=8.0, capacity=2)
    for tail in (1, 2, 3):
        s.record([tail], "r0", 0.0, None)
    assert s.continued([1, 9], 1) is None
    assert s.continued([3, 9], 1) == 3


@pytest.mark.parametrize(("window", "capacity"), [(0.0, 10), (-1.0, 10), (8.0, 0)])
def test_bad_sessions_arguments_are_refused(window: float, capacity: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        Sessions(window, capacity)


@pytest.mark.parametrize(
    "kw",
    [
        {"session_ramp_tokens": -1.0},
        {"session_window_s": 0.0},
        {"session_ramp_factor": 0.5},
        {"session_ramp_slack": 0.0},
        {"session_ramp_min_mean": -1.0},
    ],
)
def test_bad_ramp_config_is_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="session"):
        RouterConfig(**kw)  # type: ignore[arg-type]


def _agents(ramp: float) -> tuple[Router, list[ReplicaView]]:
    """Four replicas all holding the tool prompt; r0 carries six agent sessions in a loop
    (live), the others none; every replica equally idle otherwise, and their caches equally
    full (as in a warm fleet: a fuller cache would also make new content dearer on r0, the
    claim of `routing.policies.cache_aware`, and the ramp is what these tests are about)."""
    router = Router(RouterConfig(session_ramp_tokens=ramp))
    vs = views(4)
    for r in ("r0", "r1", "r2", "r3"):
        router.record_route(r, feats(TOOLS + f"warm {r} " * 40), 0.0)
    for a in range(6):
        prompt = TOOLS + f"task of agent {a} " * 40
        for call in range(3):  # the next calls follow the context to r0
            f = feats(prompt)
            d = router.pick(f, vs, float(call))
            assert d.replica == "r0" or call == 0
            router.record_route("r0", f, float(call))
            prompt += f" result {call} of agent {a} " * 20
    index = router.state.index
    for r in ("r1", "r2", "r3"):  # other traffic fills their caches as much as r0's
        other = (f"other traffic on {r}. " * 2_000)[: 256 * (index.used("r0") - index.used(r))]
        router.record_route(r, feats(other), 0.0)
        router.record_answered(r, feats(other), 0.1)
    assert len({index.used(r) for r in ("r0", "r1", "r2", "r3")}) == 1
    return router, vs


def test_new_sessions_leave_a_replica_carrying_more_live_contexts_than_the_mean() -> None:
    router, vs = _agents(8_192.0)
    picks = [router.pick(feats(TOOLS + f"new task {k} " * 40), vs, 3.0).replica
             for k in range(40)]
    assert "r0" not in picks
    ranked = router.pick(feats(TOOLS + "new task x " * 40), vs, 3.0, explain=True).ranked
    assert ranked[-1].replica == "r0"  # dearest: the ramp, nothing else tells it apart


def test_without_the_ramp_new_sessions_still_tie_over_all_holders() -> None:
    router, vs = _agents(0.0)
    picks = {router.pick(feats(TOOLS + f"new task {k} " * 40), vs, 3.0).replica
             for k in range(40)}
    assert "r0" in picks


def test_a_continued_session_stays_on_its_busy_holder() -> None:
    router, vs = _agents(8_192.0)
    prompt = TOOLS + "task of agent 0 " * 40
    for call in range(3):
        prompt += f" result {call} of agent 0 " * 20
    d = router.pick(feats(prompt), vs, 3.0)
    assert d.replica == "r0"
    assert d.reason == "prefix-hit"


def test_no_ramp_while_the_pool_has_too_few_live_contexts() -> None:
    router, vs = _agents(8_192.0)
    # long after the window: every context has gone quiet, r0 no dearer than the rest
    picks = {router.pick(feats(TOOLS + f"new task {k} " * 40), vs, 30.0).replica
             for k in range(40)}
    assert "r0" in picks


def test_a_peers_routes_continue_and_make_contexts_live_as_ours_do() -> None:
    s = Sessions(window_s=8.0)
    _call(s, [1, 2], "r0", 0.0)  # ours
    s.peer_routed("r1", [1, 2, 3], 1.0)  # another gateway's next call: continues tail 2
    s.peer_routed("r1", [1, 2, 3, 4], 2.0)
    assert dict(s.live(2.0)) == {"r1": 1}
    assert _call(s, [1, 2, 3, 4, 5], "r1", 3.0) == 4  # and ours continues the peer's
    assert dict(s.live(3.0)) == {"r1": 1}
    s.peer_routed("r2", [7, 8], 3.0)  # a new context: nothing to continue
    assert dict(s.live(3.0)) == {"r1": 1}



def test_a_peers_chain_continues_its_deepest_tail_within_its_last_blocks() -> None:
    """The tail a peer's route continues is the deepest earlier tail among its chain's last
    64 blocks (short chains: all of them); a tail further back is a new context."""
    s = Sessions(window_s=8.0)
    head = list(range(100, 200))
    s.record(head[:3], "r0", 0.0, None)  # tails 102 and 109: 109 is the deeper one
    s.record(head[:10], "r0", 0.0, None)
    for t in (1.0, 2.0):  # continues 109 twice: live where the peer sent it
        s.peer_routed("r1", head[:12 + int(t)], t)
    assert dict(s.live(2.0)) == {"r1": 1}
    s.record([7, 8], "r0", 3.0, None)
    long_chain = [7, 8, *range(1000, 1070)]  # tail 8 lies 70 blocks from the end: not seen
    s.peer_routed("r2", long_chain, 3.0)
    s.peer_routed("r2", [*long_chain, 5000], 3.5)  # continues the long chain's own tail
    assert dict(s.live(3.5)) == {"r1": 1}  # one quick return so far (8 was not continued)
    s.peer_routed("r2", [*long_chain, 5000, 5001], 4.0)  # a second quick return: live
    assert dict(s.live(4.0)) == {"r1": 1, "r2": 1}


def test_peers_routes_alone_expire_the_contexts_gone_quiet() -> None:
    """A gateway that picks nothing (out of its load balancer) but applies its peers' routes
    keeps only the contexts of the last window, however many came and went."""
    s = Sessions(window_s=8.0)
    for k in range(1_000):
        base = 10 * k
        for call in range(3):  # an agent's three quick calls: live
            s.peer_routed("r1", list(range(base, base + 2 + call)), float(k) + call * 0.1)
    assert len(s._live) <= 10


def test_new_sessions_leave_a_replica_whose_live_contexts_another_gateway_routed() -> None:
    a, b = Router(), Router()
    a.enable_sharing(2.0, "a")
    b.enable_sharing(2.0, "b")
    vs = views(4)
    for r in ("r0", "r1", "r2", "r3"):
        b.record_route(r, feats(TOOLS + f"warm {r} " * 40), 0.0)
    for agent in range(6):  # gateway a routes the agents' calls to r0; b applies its records
        prompt = TOOLS + f"task of agent {agent} " * 40
        for call in range(3):
            a.record_route("r0", feats(prompt), float(call))
            b.apply_peer_routes(a.drain_outbox(), "a", float(call))
            prompt += f" result {call} of agent {agent} " * 20
    picks = [b.pick(feats(TOOLS + f"new task {k} " * 40), vs, 3.0).replica for k in range(40)]
    assert "r0" not in picks


def test_a_context_counts_where_its_request_went_not_where_it_was_picked() -> None:
    s = Sessions(window_s=8.0)
    chain = [1, 2]
    for t in range(3):
        _call(s, chain, "r0", float(t))
        chain = [*chain, 10 + t]
    assert dict(s.live(2.0)) == {"r0": 1}
    s.routed("r0", chain[:-1])  # sent where it was picked: nothing moves
    assert dict(s.live(2.0)) == {"r0": 1}
    s.routed("r1", chain[:-1])  # the pick's replica failed, a fallback answered
    assert dict(s.live(2.0)) == {"r1": 1}
    s.routed("r1", [7, 8])  # a chain that is no live context: nothing to move
    assert dict(s.live(2.0)) == {"r1": 1}


def test_new_sessions_avoid_the_replica_the_retries_sent_live_contexts_to() -> None:
    # Six agents' contexts are on r0; their third calls are picked for r0 and retried on r1
    # (r0 failing them): the contexts now live on r1, where their next calls will find them.
    # Before, the ramp counted them on r0 (the pick's choice) and sent new sessions to r1.
    router = Router(RouterConfig(session_ramp_tokens=8_192.0))
    vs = views(4)
    for r in ("r0", "r1", "r2", "r3"):
        router.record_route(r, feats(TOOLS + f"warm {r} " * 40), 0.0)
    for a in range(6):
        prompt = TOOLS + f"task of agent {a} " * 40
        for call in range(3):
            f = feats(prompt)
            d = router.pick(f, vs, float(call))
            assert d.replica == "r0" or call == 0
            router.record_route("r0" if call < 2 else "r1", f, float(call))
            prompt += f" result {call} of agent {a} " * 20
    picks = {router.pick(feats(TOOLS + f"new task {k} " * 40), vs, 3.0).replica
             for k in range(40)}
    assert "r1" not in picks


def test_the_share_of_live_contexts_that_came_back_is_learned() -> None:
    s = Sessions(window_s=8.0)
    assert s.returning == 1.0  # nothing seen yet
    for k in range(4):  # four contexts, live from their third quick call; the fourth returns
        chain = [100 * k, 100 * k + 1]
        for call in range(4):
            _call(s, chain, "r0", float(call))
            chain = [*chain, 100 * k + 2 + call]
    assert s.returning == 1.0  # four live contexts came back, none went quiet
    s.live(20.0)  # then all four went quiet
    assert s.returning == pytest.approx(4 / 8)
    chain = [7, 8]
    for call in range(3):  # one more, live; then its next call comes after the window
        _call(s, chain, "r1", 30.0 + call)
        chain = [*chain, 9 + call]
    _call(s, chain, "r1", 50.0)
    assert s.returning == pytest.approx(4 / 9)


def _holders(ramp: float, busy: int) -> tuple[Router, list[ReplicaView]]:
    """Two replicas holding the system prompt. r0 carries three conversations in a quick
    back-and-forth (live), none of them in flight now; r1 carries no live context and has
    ``busy`` requests in flight."""
    router = Router(RouterConfig(session_ramp_tokens=ramp))
    for r in ("r0", "r1"):
        router.record_route(r, feats(TOOLS + f"warm {r} " * 40), 0.0)
    vs = [ReplicaView(id="r0", pool="p"), ReplicaView(id="r1", pool="p", inflight=busy)]
    for c in range(3):
        prompt = TOOLS + f"conversation {c} " * 40
        for turn in range(3):  # picked, and sent to r0 (where the context then lives)
            router.pick(feats(prompt), views(2), float(turn))
            router.record_route("r0", feats(prompt), float(turn))
            prompt += f" turn {turn} of conversation {c} " * 20
    assert dict(router.policy._sessions.live(3.0)) == {"r0": 3}  # type: ignore[attr-defined]
    return router, vs


def test_a_new_context_is_not_sent_to_a_busier_holder_than_the_one_carrying_live_ones() -> None:
    # Before, the ramp counted live contexts alone: r0's three made it dearer than r1, whose
    # six requests in flight it did not see, and the new conversation went there (a big
    # tenant's conversations, skewed-tenants: the busier holder then refused their next
    # turns). Foreseen in flight, r0 has 3 (its contexts calling again), r1 has 6.
    router, vs = _holders(8_192.0, busy=6)
    picks = {router.pick(feats(TOOLS + f"new conversation {k} " * 40), vs, 3.0).replica
             for k in range(20)}
    assert picks == {"r0"}


def test_live_contexts_count_as_much_as_live_contexts_came_back() -> None:
    # Ten conversations went live on r0 and then quiet, none calling again (a tenant's
    # conversations retired by newer ones): three live on r0 now foresee no calls, and a
    # new context may go to r0 as to r1. Counted in full they charged r0, every time.
    router = Router(RouterConfig(session_ramp_tokens=8_192.0))
    vs = views(2)
    for r in ("r0", "r1"):
        router.record_route(r, feats(TOOLS + f"warm {r} " * 40), 0.0)

    def converse(c: int, start: float) -> None:
        prompt = TOOLS + f"conversation {c} " * 40
        for turn in range(3):
            router.pick(feats(prompt), vs, start + turn)
            router.record_route("r0", feats(prompt), start + turn)
            prompt += f" turn {turn} of conversation {c} " * 20

    for c in range(10):
        converse(c, 0.0)
    for c in range(10, 13):
        converse(c, 20.0)  # the ten went quiet meanwhile
    sessions = router.policy._sessions  # type: ignore[attr-defined]
    assert dict(sessions.live(23.0)) == {"r0": 3}
    assert sessions.returning == 0.0
    picks = {router.pick(feats(TOOLS + f"new conversation {k} " * 40), vs, 23.0).replica
             for k in range(20)}
    assert "r0" in picks
