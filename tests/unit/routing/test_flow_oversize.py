"""A hog's request too large for spare room even on an idle replica.

A tenant over its share of the in-flight tokens and of what it sent lately (a hog) goes only
to a replica with spare room: room under the saturation rule scaled by ``1 - share_headroom``
that it leaves under the scaled KV knee with its tokens in. A request whose tokens alone are
past that knee on every replica (a long-context model's request on replicas whose cache holds
little more than one context) never fits: it waited for spare room no replica could give,
its tenant's later requests queued behind it, until its longest wait shed it with a 429 the
SDK retries, to wait again. Now it goes where spare room is as large as it can be: a replica
with nothing in flight, fleet-wide.
"""

from __future__ import annotations

from typing import Any

from routing.flow import FlowConfig, PoolFlow, Saturation
from routing.peers import ReplicaLoad
from routing.types import ReplicaView

# spare room at headroom 0.5: under 0.45 of the cache with the request in
RULE = Saturation(max_prefill_tokens=100_000, max_unanswered=None, max_waiting=100,
                  kv_knee=0.9)
CACHE = 10_000


def view(rid: str, **kw: Any) -> ReplicaView:
    return ReplicaView(id=rid, pool="p", cache_capacity_tokens=CACHE, waiting=0.0, **kw)


def hogged() -> PoolFlow[str]:
    """A pool where "noisy" is a hog: it holds and sent most of the tokens."""
    flow: PoolFlow[str] = PoolFlow(FlowConfig(saturation=RULE, share_cap=1.0,
                                              share_headroom=0.5))
    flow.sent("noisy", 6000, 0.0)
    flow.sent("quiet", 100, 0.0)
    return flow


def test_a_hogs_request_past_the_spare_knee_goes_to_an_idle_replica() -> None:
    idle = [view("busy", kv_usage=0.3, inflight=1, inflight_prefill_tokens=200),
            view("idle", kv_usage=0.0)]
    flow = hogged()
    assert flow.standing("noisy", idle, 5000, 1.0).hog
    flow.offer("big", tenant="noisy", band=1, cost=5000, now=1.0, max_wait_s=60)
    flow.offer("next", tenant="noisy", band=1, cost=100, now=1.0, max_wait_s=60)
    out = flow.release(idle, 2.0)  # 5,000 of 10,000: past 0.45 even on the idle replica
    assert out is not None and out.handle == "big"
    narrowed = flow.with_room(idle, {}, 4900, tenant="noisy", cost=5000, now=2.0)
    assert [v.id for v in narrowed if v.healthy] == ["idle"]  # nobody else's work there
    assert flow.standing("noisy", idle, 5000, 2.0).spare == ("idle",)
    after = flow.release(idle, 2.0)  # its tenant's next request is not held behind it
    assert after is not None and after.handle == "next"
    assert flow.admit(idle, 5000, 2.0, tenant="noisy")  # nor queued, with an idle replica


def test_it_still_waits_while_every_replica_is_busy_and_a_fitting_one_waits_for_room() -> None:
    busy = [view("a", kv_usage=0.3, inflight=1, inflight_prefill_tokens=200),
            view("b", kv_usage=0.5)]  # b: past the spare knee now
    flow = hogged()
    flow.offer("big", tenant="noisy", band=1, cost=5000, now=1.0, max_wait_s=60)
    assert flow.release(busy, 2.0) is None  # a holds work: no spare room anywhere
    assert flow.release([view("c", kv_usage=0.0)], 2.0, {"c": ReplicaLoad(1)}) is None
    assert flow.standing("noisy", busy, 5000, 2.0).spare == ()
    # a request that fits once room frees is held for that, as before
    small = hogged()
    small.offer("s", tenant="noisy", band=1, cost=3000, now=1.0, max_wait_s=60)
    roomy = [view("a", kv_usage=0.3), view("b", kv_usage=0.2)]
    assert small.release(roomy, 2.0) is None  # 0.2 + 0.3 past 0.45 on both
    out = small.release([view("a", kv_usage=0.1)], 3.0)
    assert out is not None and out.handle == "s"
