"""Tier resolution on live load: the scrape reconciled with kvgate's own requests in flight.

The scraped levels alone are stale for a whole scrape interval: a home pool scraped idle
kept every request of a burst, and a pool kvgate had just filled looked idle to borrow.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policy_doc import parse_policy
from gateway.tenancy.tiers import LoadSignal, live_load, resolve_tier
from routing.peers import ReplicaLoad as PeerLoad
from routing.types import ReplicaView

POLICY = parse_policy({
    "pools": {"home": {"served_model": "m-home", "replicas": ["http://a:1", "http://a:2"]},
              "big": {"served_model": "m-big", "replicas": ["http://b:1"]},
              "lend": {"served_model": "m-lend", "replicas": ["http://c:1"]}},
    "models": {"m": {"spiller": "home", "borrower": "home"}},
    "tiers": {"spiller": {"spill_to": "big", "spill_when": {"waiting": 4, "kv_usage": 0.9}},
              "borrower": {"borrow_from": "lend", "spill_when": {"waiting": 4, "kv_usage": 0.9},
                           "borrow_below": {"waiting": 0, "kv_usage": 0.5}}},
})


def view(rid: str, waiting: float | None = 0.0, kv: float | None = 0.1, inflight: int = 0,
         tokens: int = 0, capacity: int | None = 100_000, running: float | None = 0.0,
         unanswered: int | None = None) -> ReplicaView:
    """A replica scraped with ``waiting``/``running``/``kv`` (None: never scraped), kvgate's
    ``inflight`` requests there (``unanswered`` of them, all by default, ``tokens`` prompt
    tokens between them)."""
    return ReplicaView(id=rid, pool=rid[0], waiting=waiting, running=running, kv_usage=kv,
                       cache_capacity_tokens=capacity, inflight=inflight,
                       inflight_prefill=inflight if unanswered is None else unanswered,
                       inflight_prefill_tokens=tokens,
                       scrape_age_s=None if waiting is None else 0.1)


def route(tier: str, views: dict[str, list[ReplicaView]]) -> str:
    live: dict[str, Sequence[LoadSignal]] = {p: [live_load(v) for v in vs]
                                             for p, vs in views.items()}
    found = resolve_tier(POLICY, "m", tier, views, 0, live)
    assert found is not None
    return found.pool


def test_live_waiting_is_kvgates_requests_past_what_the_replica_runs() -> None:
    # scraped idle: it runs at least one; the rest of what kvgate sent since waits
    assert live_load(view("a", inflight=6)).waiting == 5.0
    assert live_load(view("a", inflight=1)).waiting == 0.0
    # scraped running 4 with nothing waiting: it runs at least 4 (answered or not)
    assert live_load(view("a", running=4.0, inflight=6, unanswered=2)).waiting == 2.0
    # scraped with 2 waiting behind 3 running: it runs 3 at once
    assert live_load(view("a", waiting=2.0, running=3.0, inflight=7)).waiting == 4.0
    # the scrape saw more than kvgate sent (other clients): the scrape stands
    assert live_load(view("a", waiting=9.0, running=3.0, inflight=6)).waiting == 9.0
    assert live_load(view("a", waiting=2.0, running=None)).waiting == 2.0


def test_live_kv_adds_the_unanswered_prompts_to_the_scraped_usage() -> None:
    assert live_load(view("a", kv=0.5, tokens=40_000)).kv_usage == 0.9
    assert live_load(view("a", kv=0.5, tokens=40_000, capacity=None)).kv_usage == 0.5


def test_other_gateways_unanswered_requests_count_too() -> None:
    load = live_load(view("a", waiting=0.0, inflight=2, kv=0.5, tokens=10_000),
                     PeerLoad(inflight=5, prefill=3, prefill_tokens=30_000))
    assert load.waiting == 6.0
    assert load.kv_usage == 0.9


def test_a_replica_never_scraped_stays_unknown_whatever_kvgate_sent_it() -> None:
    load = live_load(view("a", waiting=None, kv=None, inflight=50, tokens=90_000))
    assert (load.waiting, load.kv_usage) == (None, None)
    # unknown never moves traffic: such a home pool keeps its requests
    assert route("spiller", {"home": [view("a1", None, None, 50), view("a2", None, None, 50)],
                             "big": [view("b1")]}) == "home"


def test_a_home_pool_scraped_idle_spills_once_kvgate_filled_it() -> None:
    # scraped idle, spill_when.waiting 4: one running and 3 waiting on a1 is not full yet
    idle_then = [view("a1", inflight=4), view("a2", inflight=5)]
    assert route("spiller", {"home": idle_then, "big": [view("b1")]}) == "home"
    filled = [view("a1", inflight=5), view("a2", inflight=6)]
    assert route("spiller", {"home": filled, "big": [view("b1")]}) == "big"
    # the scraped levels alone (no live loads): the burst all stays home
    found = resolve_tier(POLICY, "m", "spiller", {"home": filled, "big": [view("b1")]})
    assert found is not None and found.pool == "home"


def test_the_spill_pool_is_read_at_its_scrape() -> None:
    # how many it runs at once is not known while nothing waits there: read live, an idle
    # spill pool would look full after spill_when.waiting + 1 requests a replica
    full = [view("a1", inflight=5), view("a2", inflight=5)]
    assert route("spiller", {"home": full, "big": [view("b1", inflight=8)]}) == "big"
    assert route("spiller", {"home": full, "big": [view("b1", waiting=4.0)]}) == "home"


def test_a_pool_kvgate_just_filled_is_not_idle_to_borrow() -> None:
    full = [view("a1", waiting=5.0), view("a2", waiting=5.0)]
    assert route("borrower", {"home": full, "lend": [view("c1")]}) == "lend"
    assert route("borrower", {"home": full, "lend": [view("c1", inflight=1)]}) == "lend"
    assert route("borrower", {"home": full, "lend": [view("c1", inflight=2)]}) == "home"
    # its KV too: the scraped usage plus the prompts sent there
    assert route("borrower", {"home": full, "lend": [view("c1", tokens=45_000)]}) == "home"
