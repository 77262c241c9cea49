"""Flow control's pure core: the saturation rule, the queue's dispatch order, bounds, and
properties over arbitrary sequences (hypothesis): no band starves below its minimum share,
weights hold over long runs, idle tenants bank nothing, memory stays bounded."""

from __future__ import annotations

from typing import Any, TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.flow import (
    IDLE_FLOWS,
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    FlowConfig,
    FlowQueue,
    Holdings,
    PoolFlow,
    Saturation,
    SendRates,
    full_reason,
    pool_saturated,
    request_cost,
    with_spare,
)
from routing.flow.gate import MAX_REQUEST_COST
from routing.peers import ReplicaLoad
from routing.types import ReplicaView

H = TypeVar("H")

RULE = Saturation(max_prefill_tokens=1000, max_unanswered=3, max_waiting=2, kv_knee=0.9,
                  max_inflight=4)


def view(rid: str = "a", **kw: Any) -> ReplicaView:
    return ReplicaView(id=rid, pool="p", **kw)


# -- saturation -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kw", "peer", "reason"),
    [
        ({}, None, None),  # idle, never scraped
        ({"inflight_prefill_tokens": 999}, None, None),
        ({"inflight_prefill_tokens": 1000}, None, "prefill"),
        ({"inflight_prefill_tokens": 600}, ReplicaLoad(1, 1, 400), "prefill"),  # fleet-wide
        ({"inflight": 3}, ReplicaLoad(1), "inflight"),
        ({"inflight_prefill": 2}, None, None),
        ({"inflight_prefill": 2}, ReplicaLoad(1, 1, 10), "unanswered"),  # fresh, fleet-wide
        ({"waiting": 0.0, "kv_usage": 0.95, "inflight_prefill_tokens": 1}, None, "kv"),
        ({"waiting": 2.0, "kv_usage": 0.5}, None, None),  # queueing within the bound
        ({"waiting": 3.0, "kv_usage": 0.1}, None, "waiting"),
        ({"waiting": 1.0, "kv_usage": 0.9}, None, "kv"),  # full KV and a queue: preemption
        ({"waiting": 0.0, "kv_usage": 0.99}, None, "kv"),  # nothing waits yet, but decoding
        ({"waiting": 0.0, "kv_usage": 0.85}, None, None),  # grows into the cache: preemption
        ({"waiting": None, "kv_usage": None}, None, None),  # no scrape never makes it full
    ],
)
def test_full_reason(kw: dict[str, object], peer: ReplicaLoad | None, reason: str | None) -> None:
    assert full_reason(view("a", **kw), peer, RULE) == reason


def test_pool_saturated_needs_every_healthy_replica_full() -> None:
    full = view("a", inflight_prefill_tokens=5000)
    room = view("b")
    sick = view("c", healthy=False)
    assert pool_saturated([full, view("b", waiting=9.0)], RULE)
    assert not pool_saturated([full, room], RULE)
    assert pool_saturated([full, sick], RULE)  # the unhealthy one does not count
    assert not pool_saturated([sick], RULE)  # nothing healthy: not saturated (503 at once)
    assert not pool_saturated([], RULE)
    # another gateway's load on b fills it
    assert pool_saturated([full, room], RULE, {"b": ReplicaLoad(4, 0, 0)})


@pytest.mark.parametrize(("sequences", "prompts"), [(2**63, 1), (2**64 - 1, 1), (128, 10**6)])
def test_a_huge_n_or_batch_does_not_swallow_the_tenants_other_holdings(
    sequences: int, prompts: int,
) -> None:
    """An absurd `n` (vLLM refuses it after it was charged) or batch times the output, even
    at most `MAX_OUTPUT_TOKENS`, must stay a bounded cost: 2**63 x 2**24 tokens absorbed the
    tenant's other requests' tokens in the float sum, and its release took them back."""
    held = Holdings()
    held.add("t", request_cost(100, 20, 256))
    huge = request_cost(10, 2**24, 256, None, sequences * prompts, prompts)
    assert huge <= MAX_REQUEST_COST
    held.add("t", huge)
    held.add("u", request_cost(50, 0, 256))
    held.remove("t", huge)
    assert (held.tokens("t"), held.tokens("u"), held.total) == (120.0, 50.0, 170.0)


def test_request_cost_is_prompt_plus_expected_output() -> None:
    assert request_cost(100, 50, 256) == 150
    assert request_cost(100, None, 256) == 356


@pytest.mark.parametrize("max_tokens", [2**63 - 1, 2**64 - 1, 10**15])
def test_a_huge_max_tokens_does_not_swallow_the_tenants_other_holdings(max_tokens: int) -> None:
    """A client's absurd `max_tokens` (vLLM refuses it after it was charged) is charged a
    bounded cost: in a float sum, 2**63 tokens absorbed the tenant's other requests' tokens and
    its release took them back, leaving them counted as 0 while still in flight."""
    held = Holdings()
    held.add("t", request_cost(100, 20, 256))
    huge = request_cost(10, max_tokens, 256)
    held.add("t", huge)
    held.add("u", request_cost(50, 0, 256))
    held.remove("t", huge)
    assert (held.tokens("t"), held.tokens("u"), held.total) == (120.0, 50.0, 170.0)


def test_each_of_n_sequences_is_charged_its_output_and_the_prompt_once() -> None:
    """`n` choices share one prompt and each may generate up to `max_tokens`: charging one
    output let an n=8 tenant hold 8x the tokens fair sharing thought it held."""
    assert request_cost(100, 50, 256, sequences=4) == 300
    assert request_cost(100, None, 256, sequences=2) == 612
    assert request_cost(100, 10**9, 256, context=4096, sequences=3) == 100 + 3 * 3996
    assert request_cost(100, 50, 256, sequences=0) == 150  # never below one sequence


def test_the_expected_output_is_at_most_what_fits_in_the_models_context() -> None:
    """A replica produces no more than fits beside the prompt, and refuses a request that
    asks for more: charging it 2**24 tokens only pushed its tenant back."""
    assert request_cost(100, 10**9, 256, context=4096) == 4096
    assert request_cost(100, None, 8192, context=4096) == 4096
    assert request_cost(100, 50, 256, context=4096) == 150
    assert request_cost(5000, 50, 256, context=4096) == 5000  # the prompt alone: no output


def test_a_refused_request_gives_back_its_place_in_the_fair_order() -> None:
    """A queued request charged 2**24 tokens of output the replica refused (before any) moved
    its tenant's finish tag 2**24 tokens ahead: its next requests went behind every other
    tenant's for as long. Refunded, they take their place again, and its recent sends count
    the prompt alone."""
    flow: PoolFlow[str] = PoolFlow(FlowConfig(saturation=RULE))
    flow.offer("bad", tenant="a", band=0, cost=10 + 2**24, now=0.0, max_wait_s=60)
    bad = flow.pop(0.0)
    assert bad is not None
    for h in ("b1", "b2", "b3"):
        flow.offer(h, tenant="b", band=0, cost=100, now=0.0, max_wait_s=60)
    flow.offer("a1", tenant="a", band=0, cost=100, now=0.0, max_wait_s=60)
    flow.refund("a", 2**24, 0.0, bad)
    flow.done("a", bad.cost)
    assert flow.rates.rate("a", 0.0) == pytest.approx(10 / flow.rates.window_s)
    assert flow.holdings.total == 0
    order = []
    while (e := flow.pop(0.0)) is not None:
        order.append(e.handle)
    assert order == ["b1", "a1", "b2", "b3"]


def test_a_refund_the_virtual_time_has_passed_moves_nobody() -> None:
    """Once the band's virtual time passed the refused request's finish tag its charge holds
    nobody back, and its tenant's flow may be a new one: nothing is given back there."""
    q: FlowQueue[str] = FlowQueue(100, default_min_share=0.0)
    q.offer("a0", tenant="a", band=0, cost=100, now=0, max_wait_s=60)
    a0 = q.pop(0.0)
    q.offer("b0", tenant="b", band=0, cost=500, now=0, max_wait_s=60)
    q.offer("b1", tenant="b", band=0, cost=500, now=0, max_wait_s=60)
    assert q.pop(0.0) is not None and q.pop(0.0) is not None  # V = 500, past a0's finish
    a1 = q.offer("a1", tenant="a", band=0, cost=100, now=0, max_wait_s=60).entry
    assert a0 is not None and a1 is not None and a1.start == 500  # at V, not a's finish: 100
    q.refund(a0, 100, 0.0)
    assert a1.start == 500


def test_pool_flow_passes_straight_through_only_with_room_and_an_empty_queue() -> None:
    flow: PoolFlow[str] = PoolFlow(FlowConfig(saturation=RULE))
    room, full = [view("a")], [view("a", inflight=4)]
    assert flow.admit(room, 10, 0.0)
    assert not flow.admit(full, 10, 0.0)
    flow.offer("x", tenant="t", band=0, cost=10, now=0.0, max_wait_s=5)
    assert not flow.admit(room, 10, 0.1)  # something waits: no overtaking it
    assert flow.release(full, 0.2) is None
    out = flow.release(room, 0.3)
    assert out is not None and out.handle == "x"
    assert flow.admit(room, 10, 0.4)


# -- dispatch order ---------------------------------------------------------------------------
def drain(q: FlowQueue[H], now: float = 0.0) -> list[H]:
    out: list[H] = []
    while (e := q.pop(now)) is not None:
        out.append(e.handle)
    return out


def test_higher_band_first_then_arrival_order() -> None:
    q: FlowQueue[str] = FlowQueue(100, default_min_share=0.0)
    for i in range(3):
        q.offer(f"free{i}", tenant="f", band=1, cost=10, now=i, max_wait_s=60)
    q.offer("prem", tenant="p", band=0, cost=10, now=5, max_wait_s=60)
    assert drain(q) == ["prem", "free0", "free1", "free2"]


def test_bands_past_upto_wait_and_an_owed_band_keeps_its_credit() -> None:
    q: FlowQueue[str] = FlowQueue(100, min_share={1: 0.9})
    q.offer("free", tenant="f", band=1, cost=100, now=0, max_wait_s=60)
    for i in range(3):
        q.offer(f"prem{i}", tenant="p", band=0, cost=100, now=0, max_wait_s=60)
    assert [q.pop(1.0).handle for _ in range(2)] == ["prem0", "prem1"]  # type: ignore[union-attr]
    # the free band is owed now; held back, the top band's request goes and the debt stays
    assert (e := q.pop(1.0, upto=0)) is not None and e.handle == "prem2"
    assert q.pop(1.0, upto=0) is None  # only the held band is left
    assert drain(q) == ["free"]


def test_equal_weights_alternate_tenants_in_tokens_not_requests() -> None:
    q: FlowQueue[str] = FlowQueue(100, default_min_share=0.0)
    for i in range(4):  # a: four requests of 100 tokens, b: one of 400
        q.offer(f"a{i}", tenant="a", band=0, cost=100, now=0, max_wait_s=60)
    q.offer("b0", tenant="b", band=0, cost=400, now=0, max_wait_s=60)
    q.offer("b1", tenant="b", band=0, cost=400, now=0, max_wait_s=60)
    order = drain(q)
    # b's second request waits until a has caught up on tokens
    assert order.index("b1") > order.index("a3")
    assert order.index("b0") < order.index("a1")


def test_weights_scale_the_share() -> None:
    q: FlowQueue[str] = FlowQueue(1000, default_min_share=0.0)
    for i in range(30):
        q.offer(f"h{i}", tenant="heavy", band=0, cost=10, now=0, max_wait_s=60, weight=2.0)
        q.offer(f"l{i}", tenant="light", band=0, cost=10, now=0, max_wait_s=60)
    first = drain(q)[:30]
    assert sum(1 for h in first if h.startswith("h")) == 20  # 2:1


def test_an_idle_tenant_banks_no_credit() -> None:
    q: FlowQueue[str] = FlowQueue(1000, default_min_share=0.0)
    for i in range(10):
        q.offer(f"busy{i}", tenant="busy", band=0, cost=10, now=0, max_wait_s=60)
    for _ in range(5):
        q.pop(1.0)
    # the quiet tenant arrives after five dispatches: it alternates, it does not get five in a row
    for i in range(5):
        q.offer(f"quiet{i}", tenant="quiet", band=0, cost=10, now=2, max_wait_s=60)
    order = drain(q, 3.0)
    assert order[:4] in (["quiet0", "busy5", "quiet1", "busy6"],
                         ["busy5", "quiet0", "busy6", "quiet1"])


def test_lower_band_gets_its_minimum_share() -> None:
    q: FlowQueue[str] = FlowQueue(10_000, min_share={1: 0.2})
    for i in range(500):
        q.offer(f"p{i}", tenant="p", band=0, cost=10, now=0, max_wait_s=60)
        q.offer(f"f{i}", tenant="f", band=1, cost=10, now=0, max_wait_s=60)
    first = [q.pop(0.0) for _ in range(100)]
    # 20 % of the tokens, give or take the one request it waits to be owed
    assert 19 <= sum(1 for e in first if e is not None and e.band == 1) <= 20


def test_a_refused_request_gives_its_band_back_the_minimum_share_it_did_not_use() -> None:
    """A lower band pays a dispatched request's predicted cost out of its minimum-share
    credit. The replica refused it before any output (charged its prompt alone): the band
    gets the rest back, so it goes on being served as if the request had cost its prompt,
    not as if the refused output had run."""
    q: FlowQueue[str] = FlowQueue(10_000, min_share={1: 0.2})
    for i in range(200):
        q.offer(f"p{i}", tenant="p", band=0, cost=100, now=0, max_wait_s=60)
    q.offer("bad", tenant="f", band=1, cost=10 + 1000, now=0, max_wait_s=60)
    for i in range(20):
        q.offer(f"f{i}", tenant="f", band=1, cost=100, now=0, max_wait_s=60)
    first = [q.pop(0.0) for _ in range(52)]  # 51 premium dispatches earn the 1010 it costs
    bad = first[-1]
    assert bad is not None and bad.handle == "bad"
    q.refund(bad, 1000, 0.0)  # refused: charged its 10 prompt tokens only
    after = [e.handle for e in (q.pop(0.0) for _ in range(50)) if e is not None]
    # its credit is 20 % of what ran (5100 premium tokens, its 10) less the 10: 1012, and
    # each of its requests of 100 costs it 80 net: 12 go before the premium band again
    # (charged the refused 1010, 212 were left: 2)
    assert after[:13] == [*(f"f{i}" for i in range(12)), "p51"], after[:13]


def test_a_refused_request_of_the_top_band_earns_the_lower_band_no_credit() -> None:
    """The other way round: a lower band earns a share of each dispatched request's cost,
    and a refused one's output never ran, so that share is taken back too."""
    q: FlowQueue[str] = FlowQueue(10_000, min_share={1: 0.5})
    q.offer("bad", tenant="p", band=0, cost=10 + 1000, now=0, max_wait_s=60)
    for i in range(5):
        q.offer(f"p{i}", tenant="p", band=0, cost=10, now=0, max_wait_s=60)
    q.offer("f0", tenant="f", band=1, cost=500, now=0, max_wait_s=60)
    bad = q.pop(0.0)  # f0 earns 505 (half of 1010): owed at once
    assert bad is not None and bad.handle == "bad"
    q.refund(bad, 1000, 0.0)  # half of the 10 that ran: 5, not owed any more
    assert [e.handle for e in (q.pop(0.0) for _ in range(6)) if e is not None] == [
        "p0", "p1", "p2", "p3", "p4", "f0"]


# -- bounds -----------------------------------------------------------------------------------
def test_a_full_queue_sheds_the_lowest_band_newest_first() -> None:
    q: FlowQueue[str] = FlowQueue(3)
    for i in range(3):
        q.offer(f"f{i}", tenant=f"t{i}", band=1, cost=10, now=i, max_wait_s=60)
    offer = q.offer("p", tenant="p", band=0, cost=10, now=5, max_wait_s=60)
    assert offer.entry is not None and [e.handle for e in offer.evicted] == ["f2"]
    # a newcomer of the lowest band with no bigger backlog to displace is rejected
    offer = q.offer("f9", tenant="t0", band=1, cost=10, now=6, max_wait_s=60)
    assert offer.entry is None and not offer.evicted
    assert len(q) == 3


def test_a_full_queue_sheds_the_noisiest_tenant_of_the_same_band() -> None:
    q: FlowQueue[str] = FlowQueue(4)
    for i in range(4):
        q.offer(f"noisy{i}", tenant="noisy", band=1, cost=10, now=i, max_wait_s=60)
    offer = q.offer("quiet", tenant="quiet", band=1, cost=10, now=5, max_wait_s=60)
    assert offer.entry is not None and [e.handle for e in offer.evicted] == ["noisy3"]
    offer = q.offer("noisy4", tenant="noisy", band=1, cost=10, now=6, max_wait_s=60)
    assert offer.entry is None  # its own backlog is the biggest: it is the one turned away


def test_max_queue_zero_never_queues() -> None:
    q: FlowQueue[str] = FlowQueue(0)
    assert q.offer("x", tenant="t", band=0, cost=1, now=0, max_wait_s=1).entry is None


def test_expiry_and_removal() -> None:
    q: FlowQueue[str] = FlowQueue(10)
    a = q.offer("a", tenant="t", band=0, cost=10, now=0, max_wait_s=1).entry
    b = q.offer("b", tenant="t", band=0, cost=10, now=0, max_wait_s=5).entry
    c = q.offer("c", tenant="t", band=0, cost=10, now=0, max_wait_s=5).entry
    assert a is not None and b is not None and c is not None
    assert q.next_deadline() == 1
    assert q.remove(b) and not q.remove(b)
    assert c.start == 10  # moved up into b's place
    assert [e.handle for e in q.expire(1.0)] == ["a"]
    assert q.next_deadline() == 5
    assert drain(q) == ["c"] and len(q) == 0


def test_wait_estimate_from_the_dispatch_rate() -> None:
    q: FlowQueue[str] = FlowQueue(10, rate_window_s=10)
    assert q.wait_estimate(0, 0.0) is None
    for t in range(100):
        q.note_dispatch(100.0, t / 10)  # 1000 tokens/s for 10 s
    q.offer("x", tenant="t", band=0, cost=2000, now=10, max_wait_s=60)
    est = q.wait_estimate(0, 10.0)
    assert est is not None and 1.9 < est < 2.1  # 2000 tokens at 1000 tokens/s


def test_retry_after_is_the_drain_time_within_its_bounds() -> None:
    """What a shed request is told: the queue ahead of it over the recent dispatch rate, 1 to
    60 s; with no dispatch seen to estimate from, not 1 s (a retry storm) but as long as the
    queue has gone without moving: its oldest wait, or the shed request's own."""
    q: FlowQueue[str] = FlowQueue(10, rate_window_s=10)
    assert q.retry_after(0, 0.0) == RETRY_AFTER_MIN_S  # nothing queued, nothing known
    q.offer("old", tenant="t", band=0, cost=10, now=0.0, max_wait_s=60)
    assert q.retry_after(0, 12.5) == 13  # nothing dispatched: the oldest has waited 12.5 s
    assert q.retry_after(0, 1.0, waited=30.2) == 31  # a request shed at its 30 s max_wait
    assert q.retry_after(0, 500.0) == RETRY_AFTER_MAX_S
    for t in range(100):
        q.note_dispatch(100.0, t / 10)  # 1000 tokens/s for 10 s
    q.offer("x", tenant="t", band=0, cost=2000, now=10, max_wait_s=60)
    assert q.retry_after(0, 10.0, waited=30.0) == 3  # ~2010 tokens at 1000 tokens/s
    q.offer("y", tenant="t", band=0, cost=10**7, now=10, max_wait_s=60)
    assert q.retry_after(0, 10.0) == RETRY_AFTER_MAX_S
    empty: FlowQueue[str] = FlowQueue(10, rate_window_s=10)
    empty.note_dispatch(100.0, 0.0)
    assert empty.retry_after(0, 0.0) == RETRY_AFTER_MIN_S



def test_retry_after_follows_the_pace_of_a_burst_from_its_first_second() -> None:
    """The dispatch rate's weighted average starts at 0 (and after a quiet spell holds
    only what is left of the last one): a burst shed in its first seconds was told the queue
    drained at a tenth of its pace (60 s, for a queue that drained in 6 s)."""
    q: FlowQueue[str] = FlowQueue(1000, rate_window_s=10)
    for _ in range(8):  # the pool fills: 8 requests of 40 tokens at once
        q.note_dispatch(40.0, 100.0)
    for i in range(200):
        q.offer(f"r{i}", tenant="t", band=0, cost=40, now=100.1, max_wait_s=60)
    assert q.retry_after(0, 100.1) == 25  # 8,000 tokens at 8 x 40 in the first second
    for t in range(1, 21):  # then 1,000 tokens/s drain out for 2 s
        q.note_dispatch(100.0, 100 + t / 10)
    assert q.retry_after(0, 102.0) == 7  # 8,000 at about 1,150/s (it read 60)
    quiet: FlowQueue[str] = FlowQueue(1000, rate_window_s=10)
    for t in range(600):  # 1,000 tokens/s for a minute, 30 s of nothing, then 2 s of 400/s
        quiet.note_dispatch(100.0, t / 10)
    for t in range(1, 21):
        quiet.note_dispatch(40.0, 90 + t / 10)
    quiet.offer("x", tenant="t", band=0, cost=4000, now=92, max_wait_s=60)
    assert quiet.retry_after(0, 92.0) == 10  # 4,000 tokens at 400/s (it read 40)

# -- properties -------------------------------------------------------------------------------
ops = st.lists(
    st.tuples(
        st.sampled_from(["offer", "offer", "offer", "pop", "pop", "remove", "expire"]),
        st.integers(0, 5),  # tenant
        st.integers(0, 2),  # band
        st.integers(1, 5000),  # cost
    ),
    min_size=1, max_size=300,
)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 20))
def test_bounded_memory_and_consistent_counts(
    seq: list[tuple[str, int, int, int]], max_queue: int
) -> None:
    q: FlowQueue[int] = FlowQueue(max_queue, min_share={1: 0.2, 2: 0.1})
    live: dict[int, object] = {}
    now = 0.0
    for i, (op, tenant, band, cost) in enumerate(seq):
        now += 0.1
        if op == "offer":
            offer = q.offer(i, tenant=f"t{tenant}", band=band, cost=cost, now=now,
                            max_wait_s=cost / 1000)
            for gone in offer.evicted:
                assert not gone.queued
                live.pop(gone.handle)
            if offer.entry is not None:
                live[i] = offer.entry
        elif op == "pop":
            e = q.pop(now)
            if e is not None:
                live.pop(e.handle)
        elif op == "remove" and live:
            entry = live.pop(min(live))
            assert q.remove(entry)  # type: ignore[arg-type]
        else:
            for e in q.expire(now):
                live.pop(e.handle)
        assert len(q) == len(live) <= max_queue
        assert sum(q.depth().values()) == len(q)
        assert q.flows() <= len(q) + 3 * (8 + IDLE_FLOWS)
        assert len(q._deadlines) <= 2 * len(q) + 65
    assert sorted(drain(q)) == sorted(live)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 4000), min_size=400, max_size=400),
    st.sampled_from([0.05, 0.1, 0.25, 0.4]),
)
def test_no_band_starves_below_its_minimum_share(costs: list[int], share: float) -> None:
    """Both bands always backlogged: the lower one gets >= its share of the tokens, minus at
    most one request's worth (plus the share of one)."""
    q: FlowQueue[int] = FlowQueue(10_000, min_share={1: share})
    it = iter(costs)
    for i in range(100):
        q.offer(i, tenant="hi", band=0, cost=next(it), now=0, max_wait_s=1e9)
        q.offer(i, tenant="lo", band=1, cost=next(it), now=0, max_wait_s=1e9)
    served = {0: 0.0, 1: 0.0}
    while q.depth().get(0) and q.depth().get(1):
        e = q.pop(0.0)
        assert e is not None
        served[e.band] += e.cost
        total = served[0] + served[1]
        assert served[1] >= share * total - (1 + share) * 4000 - 1e-6


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 3000), min_size=600, max_size=600),
    st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=3, max_size=3),
)
def test_weights_hold_over_long_runs(costs: list[int], weights: list[float]) -> None:
    """Three always-backlogged tenants: each one's tokens track its weight's share to within
    one request of the largest size per tenant."""
    q: FlowQueue[int] = FlowQueue(10_000)
    it = iter(costs)
    for i in range(200):
        for t, w in enumerate(weights):
            q.offer(i, tenant=f"t{t}", band=0, cost=next(it), now=0, max_wait_s=1e9, weight=w)
    served = [0.0, 0.0, 0.0]
    while all(q.depth().get(0, 0) and n for n in _backlogged(q)):
        e = q.pop(0.0)
        assert e is not None
        served[int(e.tenant[1])] += e.cost
    normalized = [s / w for s, w in zip(served, weights, strict=True)]
    assert max(normalized) - min(normalized) <= 2 * 3000 / min(weights) + 1e-6


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1), st.integers(1, 500)),
             min_size=1, max_size=40),
    st.sets(st.integers(0, 3)), st.sets(st.integers(0, 3)),
)
def test_only_held_tenants_wait(
    reqs: list[tuple[int, int, int]], skip: set[int], held: set[int]
) -> None:
    """Passing over and holding: a request of a held tenant is never handed out while its
    tenant is held, and `pop` gives nothing only when every waiting tenant is held (a
    skipped tenant is held only when ``hold`` says so; one that is not skipped never)."""
    q: FlowQueue[int] = FlowQueue(1000, default_min_share=0.1)
    for i, (tenant, band, cost) in enumerate(reqs):
        q.offer(i, tenant=f"t{tenant}", band=band, cost=cost, now=0, max_wait_s=1e9)
    names = {f"t{t}" for t in skip}
    stuck = {f"t{t}" for t in skip & held}
    while q:
        waiting = set(q.waiting())
        e = q.pop(0.0, names, lambda entry: entry.tenant in stuck)
        if e is None:
            assert waiting <= stuck
            break
        assert e.tenant not in stuck


def _backlogged(q: FlowQueue[int]) -> list[int]:
    counts = {"t0": 0, "t1": 0, "t2": 0}
    for e in q.entries():
        counts[e.tenant] += 1
    return list(counts.values())


# -- the share cap ----------------------------------------------------------------------------
def test_holdings_over_share_by_weight_among_tenants_holding_or_waiting() -> None:
    h = Holdings()
    h.add("noisy", 300)
    assert h.over_share({}) == set()  # alone: never over its share
    assert h.over_share({"quiet": 1.0}) == {"noisy"}  # someone waits: 300 of 300 > 1/2
    h.add("quiet", 100)
    assert h.over_share({}) == {"noisy"}  # 3/4 of the tokens, due 1/2
    assert h.over_share({}, factor=2.0) == set()  # up to twice its due: up to all of them
    assert h.over_share({"a": 1.0, "b": 1.0}, factor=2.0) == {"noisy"}  # 3/4 > 2 x 1/4
    assert h.over("noisy", {}) and not h.over("quiet", {})
    h.add("noisy", 0, weight=3.0)  # at weight 3 its due is 3/4: not over
    assert h.over_share({}) == set()
    h.remove("noisy", 0)
    h.remove("noisy", 300)
    assert h.tokens("noisy") == 0 and h.total == 100 and len(h) == 1
    h.remove("quiet", 100)
    assert h.total == 0 and len(h) == 0


CAP = Saturation(max_prefill_tokens=1000, max_unanswered=None, max_waiting=100, kv_knee=1.0)
ROOM, NEAR, FULL = ([view("a", inflight_prefill_tokens=n)] for n in (0, 700, 1000))


def capped(share_cap: float | None = 1.0, headroom: float = 0.5) -> PoolFlow[str]:
    return PoolFlow(FlowConfig(saturation=CAP, share_cap=share_cap, share_headroom=headroom))


@pytest.mark.parametrize("share_cap", [1.0, None])
def test_an_over_share_tenant_waits_while_another_tenants_request_passes(
    share_cap: float | None,
) -> None:
    flow = capped(share_cap, headroom=0.0)
    flow.sent("noisy", 900, 0.0)
    flow.sent("quiet", 100, 0.0)
    flow.offer("n1", tenant="noisy", band=1, cost=100, now=1.0, max_wait_s=60)
    flow.offer("q1", tenant="quiet", band=1, cost=100, now=2.0, max_wait_s=60)
    assert flow.release(FULL, 3.0) is None  # no room: nobody
    first = flow.release(ROOM, 3.0)
    # noisy holds 9/10 of the in-flight tokens: quiet's later request passes it (without the
    # cap, fair queueing alone sends noisy's, queued first at the same virtual time)
    assert first is not None and first.handle == ("q1" if share_cap else "n1")
    second = flow.release(ROOM, 3.0)  # nobody else waits: work-conserving
    assert second is not None and second.handle == ("n1" if share_cap else "q1")
    assert flow.holdings.tokens("noisy") == 1000 and flow.holdings.tokens("quiet") == 200


def test_near_saturation_an_over_share_tenant_waits_even_when_nobody_else_does() -> None:
    flow = capped(headroom=0.5)  # near saturation: 500 unanswered prompt tokens
    flow.sent("noisy", 600, 0.0)
    flow.sent("quiet", 100, 0.0)
    assert not flow.admit(NEAR, 50, 1.0, tenant="noisy")  # the headroom is the others'
    assert flow.admit(NEAR, 50, 1.0, tenant="quiet")  # under its share: straight through
    assert flow.admit(ROOM, 50, 1.0, tenant="noisy")  # below the headroom: straight through
    flow.offer("n", tenant="noisy", band=1, cost=50, now=1.0, max_wait_s=60)
    assert flow.release(NEAR, 2.0) is None  # room, but noisy is over its share
    out = flow.release(ROOM, 3.0)
    assert out is not None and out.handle == "n"


def test_a_tenant_alone_is_never_held_by_the_cap() -> None:
    flow = capped(headroom=0.5)
    flow.sent("noisy", 600, 0.0)
    assert flow.admit(NEAR, 50, 1.0, tenant="noisy")
    flow.done("noisy", 50)
    flow.offer("n", tenant="noisy", band=1, cost=50, now=1.0, max_wait_s=60)
    out = flow.release(NEAR, 2.0)  # nobody else holds or waits: work-conserving
    assert out is not None and out.handle == "n"
    flow.done("noisy", 600)
    flow.done("noisy", 50)
    assert flow.holdings.total == 0


def test_the_cap_reorders_tenants_inside_a_band_never_the_bands() -> None:
    """Over its share, a premium tenant still goes before a free one; near saturation it
    waits, and the turn goes to the free tenant (under its share)."""
    for views, order in ((ROOM, ["p", "f"]), (NEAR, ["f"])):
        flow = capped(headroom=0.5)
        flow.sent("prem", 600, 0.0)
        flow.offer("p", tenant="prem", band=0, cost=100, now=1.0, max_wait_s=60)
        flow.offer("f", tenant="free", band=1, cost=100, now=1.0, max_wait_s=60)
        out = [flow.release(views, 2.0), flow.release(views, 2.0)]
        assert [e.handle for e in out if e is not None] == order


def test_a_hog_goes_only_to_a_replica_with_spare_room() -> None:
    """Over its share of the in-flight tokens and of what was sent lately: the router may
    pick only the replica the headroom's rule leaves room on (under the full rule both have
    room, and without the rule both were offered)."""
    flow = capped(headroom=0.5)  # spare: under 500 unanswered prompt tokens
    flow.sent("noisy", 600, 0.0)
    flow.sent("quiet", 100, 0.0)
    views = [view("busy", inflight_prefill_tokens=600), view("idle")]
    assert flow.admit(views, 50, 1.0, tenant="noisy")
    narrowed = flow.with_room(views, {}, 50, tenant="noisy", cost=50, now=1.0)
    assert [v.id for v in narrowed if v.healthy] == ["idle"]
    # an under-share tenant routes among every replica with room
    assert flow.admit(views, 50, 1.0, tenant="quiet")
    narrowed = flow.with_room(views, {}, 50, tenant="quiet", cost=50, now=1.0)
    assert [v.id for v in narrowed if v.healthy] == ["busy", "idle"]


def test_one_long_prompt_does_not_make_a_tenant_a_hog() -> None:
    """A tenant over its share of the in-flight tokens because of one long prompt, but not of
    what was sent lately, is only passed over in the queue: near saturation it is not held
    (the first cap held it: every request of a tenant with one long prompt in flight
    waited)."""
    flow = capped(headroom=0.5)
    for i in range(10):  # quiet sent 1,000 tokens over the last seconds, 100 still in flight
        flow.sent("quiet", 100, float(i) / 10)
        if i:
            flow.done("quiet", 100)
    flow.sent("long", 600, 1.0)  # 600 of the 700 tokens in flight, 600 of the 1,600 sent
    assert flow.over_share("long")
    assert flow.admit(NEAR, 50, 1.0, tenant="long")
    flow.sent("noisy", 5000, 1.0)  # now over both: a hog
    assert not flow.admit(NEAR, 50, 1.0, tenant="noisy")


def test_a_held_hog_does_not_hold_back_another_over_share_tenant() -> None:
    """Only two over-share tenants wait in the band and no replica has spare room: the hog
    (over in what it sent lately too) waits, the other goes, though the hog's request is
    first in fair-queueing order (the band's head; it held both, and the band's turn passed)."""
    flow = capped(headroom=0.5)
    for _ in range(20):  # quiet sent 2,000 tokens lately and holds 100
        flow.sent("quiet", 100, 0.0)
        flow.done("quiet", 100)
    flow.sent("quiet", 100, 0.0)
    for _ in range(6):  # noisy sent 3,600 lately and holds 600: over both, a hog
        flow.sent("noisy", 600, 0.0)
    for _ in range(5):
        flow.done("noisy", 600)
    flow.sent("long", 600, 0.0)  # holds 600 of the 1,300 in flight, sent 600 of 6,300
    assert flow.over_share("noisy") and flow.over_share("long")
    flow.offer("n", tenant="noisy", band=1, cost=50, now=0.0, max_wait_s=60)
    flow.offer("l", tenant="long", band=1, cost=50, now=0.0, max_wait_s=60)
    out = flow.release(NEAR, 0.0)
    assert out is not None and out.handle == "l"
    assert flow.hog_holds == 1  # the hog's request, passed over
    assert flow.release(NEAR, 0.0) is None  # the hog waits for spare room
    assert flow.release(NEAR, 0.0) is None
    assert flow.hog_holds == 1  # counted once however many releases pass it over
    out = flow.release(ROOM, 0.0)
    assert out is not None and out.handle == "n"
    assert flow.hog_holds == 1


def test_standing_of_a_hog_names_the_replicas_with_spare_room_or_says_it_waits() -> None:
    """Explain's view of a hog: its shares, and where its next request may go -- the replicas
    `with_room` narrows it to, or none (then `admit` queues it)."""
    flow = capped(headroom=0.5)
    flow.sent("noisy", 600, 0.0)
    flow.sent("quiet", 100, 0.0)
    views = [view("busy", inflight_prefill_tokens=600), view("idle")]
    got = flow.standing("noisy", views, 50, 1.0)
    assert got.over_share and got.hog and got.spare == ("idle",)
    assert got.inflight_share == pytest.approx(6 / 7) and got.fair_share == pytest.approx(0.5)
    assert got.recent_share == pytest.approx(6 / 7)
    assert flow.admit(views, 50, 1.0, tenant="noisy")  # sent: routed among the spare ones
    narrowed = flow.with_room(views, {}, 50, tenant="noisy", cost=50, now=1.0)
    assert [v.id for v in narrowed if v.healthy] == list(got.spare)
    flow.done("noisy", 50)
    waits = flow.standing("noisy", NEAR, 50, 1.0)
    assert waits.hog and waits.spare == ()
    assert not flow.admit(NEAR, 50, 1.0, tenant="noisy")  # as explain says: it waits
    quiet = flow.standing("quiet", NEAR, 50, 1.0)
    assert not (quiet.over_share or quiet.hog) and quiet.spare is None
    assert flow.standing("new", NEAR, 50, 1.0).fair_share is None  # holds nothing


def test_standing_of_one_long_prompt_is_over_share_but_not_a_hog() -> None:
    """Over its share of the in-flight tokens, not of what was sent lately: only passed over
    in its band, never held to spare room (`admit` lets it through near saturation)."""
    flow = capped(headroom=0.5)
    for i in range(10):  # quiet sent 1,000 tokens lately, 100 still in flight
        flow.sent("quiet", 100, float(i) / 10)
        if i:
            flow.done("quiet", 100)
    flow.sent("long", 600, 1.0)
    got = flow.standing("long", NEAR, 50, 1.0)
    assert got.over_share and not got.hog and got.spare is None
    assert got.inflight_share == pytest.approx(6 / 7) and got.recent_share < 0.5
    assert flow.admit(NEAR, 50, 1.0, tenant="long")
    without = capped(share_cap=None)  # no cap: nobody is over, whatever it holds
    without.sent("long", 600, 1.0)
    without.sent("quiet", 100, 1.0)
    off = without.standing("long", NEAR, 50, 1.0)
    assert not (off.over_share or off.hog) and off.spare is None


def test_with_spare_counts_the_requests_tokens() -> None:
    rule = Saturation(max_prefill_tokens=1000, max_unanswered=None, max_waiting=100,
                      kv_knee=0.5)
    kv = {"cache_capacity_tokens": 10_000, "waiting": 0.0}
    views = [view("a", kv_usage=0.3, **kv), view("b", kv_usage=0.1, **kv),
             view("c", kv_usage=0.0, inflight_prefill_tokens=400, **kv)]
    # a: KV 0.3 + 0.25 over the knee; b fits; c: 400 + 2,500 unanswered past the bound
    out = with_spare(views, rule, {}, 2500)
    assert out is not None and [v.id for v in out if v.healthy] == ["b"]
    # longer than the prefill bound: only where nothing is unanswered
    out = with_spare(views, rule, {}, 3000)
    assert out is not None and [v.id for v in out if v.healthy] == ["b"]
    assert with_spare(views, rule, {}, 6000) is None  # nowhere under the knee


def test_send_rates_decay_and_forget() -> None:
    rates = SendRates(10.0)
    rates.add("a", 100, 0.0)
    assert rates.rate("a", 0.0) == pytest.approx(10.0)
    assert rates.rate("a", 10.0) == pytest.approx(10.0 / 2.718281828, rel=1e-6)
    for i in range(SendRates.PRUNE_EVERY):  # long after: "a" is forgotten at the next prune
        rates.add(f"t{i % 3}", 1, 1000.0 + i)
    assert len(rates) == 3 and rates.rate("a", 2000.0) == 0.0


def test_saturation_scaled_is_full_earlier() -> None:
    rule = Saturation(max_prefill_tokens=1000, max_unanswered=8, max_waiting=4, kv_knee=0.9,
                      max_inflight=2)
    half = rule.scaled(0.5)
    assert (half.max_prefill_tokens, half.max_unanswered, half.max_waiting, half.kv_knee,
            half.max_inflight) == (500, 4, 2.0, 0.45, 1)
    assert rule.scaled(1.0) is rule


def test_a_hog_is_not_held_for_spare_room_in_a_pool_without_a_healthy_replica() -> None:
    """Every replica down: the pool is not saturated (holding requests would not help, routing
    answers 503 at once), for a hog too. It was held for spare room that no replica could
    give, in `admit` and at each release, until its longest wait shed it with a 429 saying the
    replicas were saturated."""
    flow = capped(headroom=0.5)
    flow.sent("noisy", 600, 0.0)
    flow.sent("quiet", 100, 0.0)
    down = [view("a", healthy=False, inflight_prefill_tokens=700)]
    assert flow.standing("noisy", NEAR, 50, 1.0).hog  # a hog, held while the pool is near
    assert not flow.admit(NEAR, 50, 1.0, tenant="noisy")
    got = flow.standing("noisy", down, 50, 1.0)
    assert got.hog and got.spare is None  # explain: it does not wait for spare room
    assert flow.admit(down, 50, 1.0, tenant="noisy")  # straight through, to its 503
    flow.done("noisy", 50)
    flow.offer("n", tenant="noisy", band=1, cost=50, now=1.0, max_wait_s=60)
    assert flow.release(NEAR, 2.0) is None
    out = flow.release(down, 2.0)  # released, to be answered 503 at once
    assert out is not None and out.handle == "n"
    assert flow.with_room(down, {}, 50, tenant="noisy", cost=50, now=2.0) == down


def test_the_smallest_policy_weight_keeps_the_band_fair_after_a_long_run() -> None:
    """A request advances its band's virtual time by cost / weight: a weight of 1e-300 took it
    to infinity within a few hundred requests, and the band was first come, first served for
    every tenant from then on. The policy's floor (1e-3, `gateway.policy_doc.Weight`) leaves
    10,000 requests of a million tokens each at that weight with the tags still apart."""
    floor = 1e-3  # (below it the policy is refused: tests/unit/gateway/test_flow_config.py)
    q: FlowQueue[tuple[str, int]] = FlowQueue(20_000)
    for i in range(10_000):
        q.offer(("tiny", i), tenant="tiny", band=0, cost=1e6, now=0.0, max_wait_s=60,
                weight=floor)
        q.pop(0.0)
    for i in range(6):
        q.offer(("hog", i), tenant="hog", band=0, cost=100, now=0.0, max_wait_s=60)
    for i in range(2):
        q.offer(("quiet", i), tenant="quiet", band=0, cost=100, now=0.0, max_wait_s=60)
    order = [e.handle[0] for e in iter(lambda: q.pop(0.0), None)]
    assert order[:4] == ["hog", "quiet", "hog", "quiet"], order
