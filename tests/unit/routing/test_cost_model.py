from __future__ import annotations

import pytest

from routing.config import RouterConfig
from routing.features import extract_features
from routing.router import Router
from routing.types import ReplicaView

from .helpers import feats, views

DOC = "a long shared document " * 400  # ~2,300 tokens


def _router_with_doc_on(replica: str, cfg: RouterConfig | None = None) -> Router:
    r = Router(cfg)
    r.record_route(replica, feats(DOC), 0.0)
    r.record_first_token(replica, feats(DOC), 0.3, 0.3)
    return r


def _terms(
    r: Router, vs: list[ReplicaView], text: str = DOC, now: float = 1.0
) -> dict[str, dict[str, float]]:
    d = r.pick(feats(text), vs, now, explain=True)
    return {c.replica: {**c.terms, "cost": c.cost} for c in d.ranked}


def test_prefix_hit_is_cheaper_and_wins() -> None:
    r = _router_with_doc_on("r1")
    d = r.pick(feats(DOC + "question"), views(3), 1.0, explain=True)
    assert (d.replica, d.reason) == ("r1", "prefix-hit")
    t = {c.replica: c.terms for c in d.ranked}
    assert t["r1"]["uncached_tokens"] < t["r0"]["uncached_tokens"]
    assert t["r1"]["matched_tokens"] > 0 and t["r0"]["matched_tokens"] == 0
    assert [c.cost for c in d.ranked] == sorted(c.cost for c in d.ranked)
    assert all(0.0 <= c.terms["score"] <= 1.0 for c in d.ranked)
    assert d.ranked[0].terms["score"] == 1.0


@pytest.mark.parametrize(
    ("r1", "expected", "reason"),
    [
        # queued prefill work on the cached replica outweighs the cache
        (
            ReplicaView(id="r1", pool="p", inflight=1, inflight_prefill_tokens=200_000),
            "r0",
            "least-cost",
        ),
        # a fresh scrape showing a long queue from other gateways
        (ReplicaView(id="r1", pool="p", waiting=100, scrape_age_s=0.1), "r0", "least-cost"),
        # ...ignored when stale (fail open to our own accounting)
        (ReplicaView(id="r1", pool="p", waiting=100, scrape_age_s=60.0), "r1", "prefix-hit"),
        # nearly full KV cache: preemption risk
        (ReplicaView(id="r1", pool="p", kv_usage=0.999, scrape_age_s=0.1), "r0", "least-cost"),
        (ReplicaView(id="r1", pool="p", kv_usage=0.5, scrape_age_s=0.1), "r1", "prefix-hit"),
    ],
)
def test_cost_terms_steer(r1: ReplicaView, expected: str, reason: str) -> None:
    r = _router_with_doc_on("r1")
    vs = [ReplicaView(id="r0", pool="p"), r1]
    d = r.pick(feats(DOC), vs, 1.0)
    assert (d.replica, d.reason) == (expected, reason)


def _loaded(prefill_tokens: int = 0) -> list[ReplicaView]:
    return [
        ReplicaView(id="r0", pool="p", inflight=1, inflight_prefill_tokens=prefill_tokens),
        ReplicaView(id="r1", pool="p"),
    ]


@pytest.mark.parametrize(
    ("gateway_tokens", "queued"),
    [
        (0, 10_000),  # the gateway does not report prompt tokens: ours count
        (3_000, 3_000),  # ours are capped by the gateway's raw count
        (50_000, 10_000),
    ],
)
def test_own_pending_work_counts_until_first_token(gateway_tokens: int, queued: int) -> None:
    r = Router()
    big = feats("x" * 40_000)  # 10,000 tokens, nothing cached
    r.record_route("r0", big, 0.0)
    assert _terms(r, _loaded(gateway_tokens), "y" * 4000, 0.0)["r0"]["queued_tokens"] == queued
    r.record_first_token("r0", big, 1.0, 1.0)
    assert _terms(r, _loaded(), "y" * 4000)["r0"]["queued_tokens"] == 0


def test_pending_work_drains_at_the_learned_rate() -> None:
    r = Router()
    r.record_route("r0", feats("x" * 40_000), 0.0)  # 10,000 tokens
    rate = r.prefill_rate("r0")
    for now in (0.25, 0.5, 1.0):
        left = _terms(r, _loaded(), "y" * 4000, now)["r0"]["queued_tokens"]
        assert left == pytest.approx(max(0.0, 10_000 - rate * now))
    # a request routed behind it waits for what is left of it, then its own work
    r.record_route("r0", feats("z" * 8_000), 0.5)
    left = _terms(r, _loaded(), "y" * 4000, 0.5)["r0"]["queued_tokens"]
    assert left == pytest.approx(10_000 - rate * 0.5 + 2_000)


def test_gateway_count_is_used_when_we_have_no_record() -> None:
    assert _terms(Router(), _loaded(7_000))["r0"]["queued_tokens"] == 7_000


def test_failure_releases_pending_work() -> None:
    r = Router()
    f = feats("x" * 8000)
    r.record_route("r0", f, 0.0)
    assert _terms(r, _loaded(), now=0.0)["r0"]["queued_tokens"] == 2000
    r.record_failure("r0", f, 0.0)
    assert _terms(r, _loaded(), now=0.0)["r0"]["queued_tokens"] == 0


def test_pending_work_expires() -> None:
    r = Router(RouterConfig(pending_ttl_s=10.0))
    r.record_route("r0", feats("x" * 8000), 0.0)
    assert _terms(r, _loaded(), now=0.0)["r0"]["queued_tokens"] == 2000
    r.record_route("r1", feats("z" * 40), 100.0)  # sweeps expired entries
    assert r.state.pending.load("r0") == (0.0, 0)


def test_prefill_rate_is_learned_per_replica() -> None:
    r = Router()
    prior = r.prefill_rate("slow")
    for i in range(30):
        tokens = 500 + 250 * i
        f = feats(f"{i} " + "q" * 4 * tokens)  # no cache
        for rid, ttft in (("slow", 0.05 + tokens / 1_000), ("fast", 0.01 + tokens / 40_000)):
            r.record_route(rid, f, float(i))
            r.record_first_token(rid, f, ttft, float(i) + ttft)
    assert r.prefill_rate("slow") < 0.25 * prior
    assert r.prefill_rate("fast") > 1.5 * prior
    d = r.pick(
        feats("new prompt " * 500),
        [ReplicaView(id="slow", pool="p"), ReplicaView(id="fast", pool="p")],
        50.0,
    )
    assert d.replica == "fast"
    r.forget_replica("slow")
    assert r.ttft_fit("slow") == r.state.ttft.fleet  # what the other replicas show


TIGHT = RouterConfig(load_factor=1.25, load_slack=1.0)  # a bound that binds at small loads


def test_bounded_load_overrides_cost() -> None:
    r = _router_with_doc_on("r1", TIGHT)
    vs = [ReplicaView(id="r0", pool="p", inflight=0), ReplicaView(id="r1", pool="p", inflight=4)]
    d = r.pick(feats(DOC), vs, 1.0, explain=True)
    assert (d.replica, d.reason) == ("r0", "overflow")
    assert d.fallbacks == ("r1",)
    assert {c.replica: c.terms["admitted"] for c in d.ranked} == {"r0": 1.0, "r1": 0.0}


@pytest.mark.parametrize(
    ("miss_weight", "replicas_used"),
    [
        # pure TTFT: once each replica holds the prompt, queueing is what differs
        (1.0, 4),
        # a miss priced at 3x its prefill: copies queue behind the three replicas that
        # already hold the prompt, up to the bound, rather than prefill it a fourth time
        (3.0, 3),
    ],
)
def test_identical_burst_spreads_deterministically(miss_weight: float, replicas_used: int) -> None:
    def burst() -> dict[str, int]:
        r = Router(RouterConfig(miss_weight=miss_weight, load_factor=1.25, load_slack=1.0))
        f = feats(DOC)
        load = {f"r{i}": 0 for i in range(4)}
        for _ in range(12):
            vs = [  # warm caches: every copy evicts what it takes
                ReplicaView(id=k, pool="p", inflight=n, inflight_prefill_tokens=n * 2300,
                            cache_capacity_tokens=2_304)
                for k, n in load.items()
            ]
            d = r.pick(f, vs, 0.0)
            r.record_route(d.replica, f, 0.0)
            load[d.replica] += 1
        return load

    first = burst()
    assert first == burst()
    assert sum(1 for n in first.values() if n) == replicas_used
    assert max(first.values()) <= 1.25 * 12 / 4 + 1  # the bound, after the last assignment


def test_capacity_from_view_bounds_the_index() -> None:
    r = Router()
    tiny = ReplicaView(id="r0", pool="p", cache_capacity_tokens=64 * 4)  # 4 of our blocks
    r.pick(feats("x"), [tiny], 0.0)
    r.record_route("r0", feats("y" * 256 * 20), 0.0)
    assert r.affinity_entries() == {"r0": 4}
    r.forget_replica("r0")
    assert r.affinity_entries() == {}


def test_a_restarted_engine_holds_nothing_and_keeps_its_learned_speed() -> None:
    r = _router_with_doc_on("r1")
    fit = r.ttft_fit("r1")
    tiny = [ReplicaView(id="r0", pool="p"),
            ReplicaView(id="r1", pool="p", cache_capacity_tokens=64 * 4)]
    r.pick(feats(DOC), tiny, 1.0)
    r.forget_cache("r1")
    assert r.affinity_entries() == {}
    assert r.pick(feats(DOC + "question"), tiny, 2.0).reason != "prefix-hit"
    assert r.ttft_fit("r1") == fit
    r.pick(feats("x"), tiny, 3.0)  # the replica's capacity holds again
    r.record_route("r1", feats("y" * 256 * 20), 3.0)
    assert r.affinity_entries() == {"r1": 4}


def test_prompt_beyond_the_hash_cap_is_charged_to_the_index() -> None:
    cfg = RouterConfig(max_blocks=4)
    r = Router(cfg)
    vs = [ReplicaView(id="r0", pool="p", cache_capacity_tokens=64 * 40)]  # 40 of our blocks
    r.pick(feats("a", config=cfg), vs, 0.0)
    r.record_route("r0", feats("y" * 256 * 4, config=cfg), 0.0)  # exactly the cap: no tail
    assert r.state.index.used("r0") == 4
    r.record_route("r0", feats("z" * 256 * 30, config=cfg), 0.0)  # 30 blocks, 4 hashed
    assert r.state.index.used("r0") == 4 + 30
    r.record_route("r0", feats("w" * 256 * 30, config=cfg), 0.0)  # the index evicts as vLLM would
    assert r.state.index.used("r0") <= 40
    w = feats("w" * 256 * 30, config=cfg).block_hashes
    # the whole capped chain matched: its tail counts as held too (30 blocks, not the 4 hashed)
    assert r.state.index.match_one("r0", w) == 30
    assert r.state.index.match(w) == {"r0": 30}
    # the z prompt lost its tail weight to make room: only its hashed blocks are predicted
    assert r.state.index.match_one("r0", feats("z" * 256 * 30, config=cfg).block_hashes) < 4


@pytest.mark.parametrize(
    ("miss_weight", "queued", "expected"),
    [
        # 3,000 queued tokens on the replica holding 2,240 of the prompt's 2,300 tokens: as a
        # pure TTFT estimate the idle replica is cheaper (2,300 < 3,000 + 60 + decode)...
        (1.0, 3_000, "r0"),
        # ...but charging a miss its cost to the fleet keeps the request with its prefix
        (2.0, 3_000, "r1"),
        # a long enough queue still outweighs the cache (5,136 > 2 x 2,300)
        (2.0, 5_000, "r0"),
    ],
)
def test_miss_weight_prices_recomputation(miss_weight: float, queued: int, expected: str) -> None:
    """(In a warm fleet: every replica's cache is full, a copy evicts what it takes.)"""
    cfg = RouterConfig(miss_weight=miss_weight)
    r = _router_with_doc_on("r1", cfg)
    # caches as full as in a warm fleet (a copy then evicts as much as it takes)
    full = 2_304
    busy = ReplicaView(id="r1", pool="p", inflight=1, inflight_prefill_tokens=queued,
                       cache_capacity_tokens=full)
    idle = ReplicaView(id="r0", pool="p", cache_capacity_tokens=full)
    d = r.pick(feats(DOC), [idle, busy], 1.0, explain=True)
    assert d.replica == expected
    t = {c.replica: c.terms for c in d.ranked}
    assert (t["r0"]["uncached_tokens"], t["r1"]["uncached_tokens"]) == (2_300, 60)


def test_miss_weight_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="miss_weight"):
        RouterConfig(miss_weight=0.5)


@pytest.mark.parametrize(
    "kwargs",
    [{"load_slack": 0.0}, {"load_slack": 0.5}, {"load_factor": 0.9}, {"block_chars": 255}],
)
def test_configs_that_could_admit_no_replica_are_rejected(kwargs: dict[str, float]) -> None:
    # with slack < 1 an idle pool would admit nobody (c * (0+1)/n + slack - 1 < 0)
    with pytest.raises(ValueError, match="routing\\."):
        RouterConfig(**kwargs)  # type: ignore[arg-type]


TOOLS = "an agent's tool prompt " * 500  # ~2,900 tokens, shared by every session of the agent
SESSION = "the session's growing context " * 2_000  # ~15,000 tokens


def _agent_router() -> Router:
    """r0 and r1 both hold the tool prompt and one session's long context each (all
    answered: nothing pending, the TTFT model at its prior)."""
    r = Router()
    other = SESSION.replace("growing", "evolving")
    for replica, text in (("r0", TOOLS + SESSION), ("r1", TOOLS + other)):
        r.record_route(replica, feats(text), 0.0)
        r.record_answered(replica, feats(text), 0.1)
    return r


def _decoding(r0: int, r1: int) -> list[ReplicaView]:
    return [ReplicaView(id="r0", pool="p", inflight=r0),
            ReplicaView(id="r1", pool="p", inflight=r1)]


def test_new_sessions_go_to_the_holder_with_fewer_decoding_requests() -> None:
    # A new agent session hits the tool prompt on both holders. Three more requests decoding
    # on r0 (each reads its long context in every step the new prefill waits through) send it
    # to r1. At the old weight (16) they tied with r1 and the hash spread the sessions: piled
    # onto the busiest holder, they fill it to the load bound, which then refuses its own
    # sessions' next calls (a whole context recomputed elsewhere).
    r = _agent_router()
    for i in range(12):
        task = TOOLS + f"task {i}: " + "do this " * (600 + 20 * i)  # ~1,200-1,700 tokens
        assert r.pick(feats(task), _decoding(4, 1), 1.0).replica == "r1"


def test_a_session_stays_on_its_busy_holder() -> None:
    # ...while a session's next call keeps its context's replica with many more requests
    # decoding there (below the bound): recomputing 15,000 tokens costs more
    r = _agent_router()
    d = r.pick(feats(TOOLS + SESSION + "tool result"), _decoding(9, 0), 1.0)
    assert (d.replica, d.reason) == ("r0", "prefix-hit")


def test_a_tie_goes_to_the_replica_with_fewer_requests_in_flight() -> None:
    # One request decoding on r0 costs a cold 5,000-token prompt ~1 % more there: the same
    # 5 % step of the tie scale as the idle r1 and r2. A tie goes to fewer in flight, then to
    # the prompt's hash; by hash alone a third of a warming fleet's cold prompts joined the
    # busy replica while others sat idle (synthetic workload, the TTFT tail).
    r = Router()
    vs = [ReplicaView(id="r0", pool="p", inflight=1), *views(3)[1:]]
    picks = [r.pick(feats(f"cold prompt {k} " * 1400), vs, 1.0) for k in range(40)]
    assert {d.replica for d in picks} == {"r1", "r2"}  # both idle ones: the hash spreads them
    ranked = r.pick(feats("cold prompt x " * 1400), vs, 1.0, explain=True).ranked
    assert ranked[-1].replica == "r0" and ranked[-1].cost < ranked[0].cost * 1.05


def _warming(fast_r0: bool) -> Router:
    """A fleet warming up: r0 has served tenant A's first requests (answered; A's prompts in
    its cache, 41 of its 4,096 blocks), r1 and r2 nothing yet. With ``fast_r0`` r0 saw their
    first tokens come at a real engine's speed, so its own fit is ~10 % faster than the
    fleet's, which still leans on the slower prior (r1 and r2 have no fit of their own)."""
    r = Router()
    for i in range(6):
        f = feats(f"tenant A {i} " * (20 + 60 * i))
        r.record_route("r0", f, float(i))
        if fast_r0:
            r.record_first_token("r0", f, 0.006 + f.prompt_tokens / 25_000, i + 0.1)
        else:
            r.record_answered("r0", f, i + 0.1)
    return r


@pytest.mark.parametrize("fast_r0", [False, True])
def test_a_new_prefix_goes_to_an_emptier_cache_while_the_fleet_warms_up(fast_r0: bool) -> None:
    # Other tenants' first prompts (nothing cached anywhere) tie on the three idle replicas,
    # or look cheaper on r0 only because its fit is its own. Before, a share of them (all,
    # with r0's faster fit) went to r0 beside tenant A; each tenant's later requests then
    # follow its prefix there, and when both tenants' conversations peak the load bound
    # refuses the holder: their prompts recomputed elsewhere were the synthetic workload's
    # TTFT tail. While a cache is empty, a prompt no replica holds any of pays for the
    # replica's fill against the mean: a new prefix goes beside none rather than another.
    r = _warming(fast_r0)
    picks = {r.pick(feats(f"tenant {k}'s system prompt " * 500), views(3), 10.0).replica
             for k in range(40)}
    assert picks == {"r1", "r2"}


@pytest.mark.parametrize("question_words", [3, 900])
def test_a_prefix_held_by_a_fuller_cache_still_goes_there(question_words: int) -> None:
    # ...the charge is on prompts no replica holds any of: tenant A's next conversation hits
    # its prompt on r0, however much new text it brings (its new text joins a prefix that
    # already has its home; were it charged, the long question would move to an empty cache)
    r = _warming(fast_r0=True)
    d = r.pick(feats("tenant A 5 " * 320 + "a new question " * question_words), views(3), 10.0)
    assert (d.replica, d.reason) == ("r0", "prefix-hit")


def test_warm_caches_are_priced_as_before() -> None:
    # Every cache full (a warm fleet): the replicas' fills are level, and a copy pays for
    # what it evicts, the same on each; r0's queue decides as before (cf. the miss weight).
    r = _router_with_doc_on("r1")
    full = 2_304
    vs = [ReplicaView(id="r0", pool="p", inflight=1, inflight_prefill_tokens=500,
                      cache_capacity_tokens=full),
          ReplicaView(id="r1", pool="p", cache_capacity_tokens=full)]
    r.record_route("r0", feats("another document " * 540), 0.5)  # r0's cache full too
    r.record_answered("r0", feats("another document " * 540), 0.6)
    t = _terms(r, vs, "a cold prompt " * 600)
    # the same copy price on both: the cost difference is r0's queue and decoding request
    spt = 1.0 / t["r0"]["prefill_tps"]
    extra = (t["r0"]["cost"] - t["r1"]["cost"]) / spt
    assert extra == pytest.approx(500 + 64, rel=1e-6)


def test_once_every_cache_holds_something_a_copy_pays_for_what_it_evicts_alone() -> None:
    # r1 holds a little, r0 much more (no cache empty): the fills now measure history, and a
    # cold prompt's copy pays the eviction price on each, as before the claim
    r = _warming(fast_r0=False)
    r.record_route("r1", feats("tenant B's prompt " * 60), 7.0)
    r.record_answered("r1", feats("tenant B's prompt " * 60), 7.1)
    t = _terms(r, views(2), "a cold prompt " * 600, 10.0)
    used, capacity = r.state.index.used, r.state.index.capacity
    uncached = t["r0"]["uncached_tokens"]
    copy = uncached / 64
    full = {k: (used(k) + copy) / capacity(k) for k in ("r0", "r1")}
    spt = 1.0 / t["r0"]["prefill_tps"]
    assert t["r0"]["cost"] - t["r1"]["cost"] == pytest.approx(
        uncached * (full["r0"] - full["r1"]) * spt, rel=1e-6)


def test_a_continued_context_stays_with_its_new_content_beside_an_empty_cache() -> None:
    # A conversation's second turn brings more new text than it repeats. Its next turns will
    # follow it wherever it goes, so its new text claims nothing: it stays on r0, although r1
    # and r2 hold nothing and r0 also holds tenant A's prompts (were its new text charged as a
    # new context's, r1 would be cheaper).
    r = _warming(fast_r0=False)
    first = "the first turn of a conversation " * 120  # ~1,000 tokens
    f = feats(first)
    assert r.pick(f, views(3), 7.0).replica is not None
    r.record_route("r0", f, 7.0)
    r.record_answered("r0", f, 7.5)
    d = r.pick(feats(first + "a long new question " * 300), views(3), 10.0)
    assert (d.replica, d.reason) == ("r0", "prefix-hit")


def test_an_empty_prompt_on_an_empty_fleet_is_routed() -> None:
    # no replica holds anything and the prompt copies nothing: no claim (and no 0 / 0)
    r = Router()
    f = extract_features({"prompt": ""}, model="m", salt="s", config=r.config)
    assert f.prompt_tokens == 0
    assert r.pick(f, views(3), 0.0).replica in {"r0", "r1", "r2"}


@pytest.mark.parametrize("waiting", [1e306, float("inf")])
def test_a_scraped_count_no_engine_could_hold_ranks_its_replica_last(waiting: float) -> None:
    """Its cost was infinite and the pick raised OverflowError (every request of the pool a
    500, the replica beside it never tried); now it is ranked last, its prefix held or not."""
    r = _router_with_doc_on("r0")
    vs = [ReplicaView(id="r0", pool="p", waiting=waiting, running=waiting, scrape_age_s=0.1),
          ReplicaView(id="r1", pool="p")]
    for explain in (False, True):
        assert r.pick(feats(DOC + "question"), vs, 1.0, explain=explain).replica == "r1"
