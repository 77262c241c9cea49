"""The fair queue's virtual time over a long uptime: it is rebased, so tags keep their
precision and a tenant arriving late still takes its turn.

A band's virtual time V grows by the tokens dispatched from the queue over the weights of the
tenants sending them, and it was never rebased: with weights at the ends of the allowed range
in one band (a batch tenant at 0.001, a premium one at 1,000), 2^52 x 0.001 / 1,000 = 4.5e9
tokens (half a day at 100k tokens/s) bring V where a 100-token request of weight 1,000 (an
advance of 0.1) no longer moves a finish tag: every such request of a tenant got the same
start tag, and a tenant arriving later than another's backlog waited behind all of it
(arrival order) instead of taking every other turn.
"""

from __future__ import annotations

from routing.flow import FlowQueue
from routing.flow.gate import MAX_REQUEST_COST


def _age(q: FlowQueue[str], dispatches: int) -> None:
    """Long uptime, fast: a weight-0.001 tenant's largest requests through the queue."""
    for i in range(dispatches):
        q.offer(f"old-{i}", tenant="batch", band=0, cost=MAX_REQUEST_COST, now=0.0,
                max_wait_s=1e9, weight=0.001)
        assert q.pop(0.0) is not None


def test_a_late_tenant_takes_every_other_turn_after_a_long_uptime() -> None:
    q: FlowQueue[str] = FlowQueue(1000, default_min_share=0.0)
    _age(q, 10)  # V ~ 1e16: the virtual time of ~1e13 tokens sent at weight 0.001
    for i in range(20):
        q.offer(f"a-{i}", tenant="a", band=0, cost=100, now=1.0, max_wait_s=1e9, weight=1000)
    q.offer("b-0", tenant="b", band=0, cost=100, now=1.0, max_wait_s=1e9, weight=1000)
    order = []
    while (e := q.pop(2.0)) is not None:
        order.append(e.handle)
    assert order.index("b-0") <= 2, order


def test_rebased_tags_keep_the_fair_order_and_refunds() -> None:
    """Equal weights after a rebase: the two tenants alternate, and a refund of a request
    dispatched before the rebase gives back only what the new virtual time has not passed."""
    q: FlowQueue[str] = FlowQueue(1000, default_min_share=0.0)
    q.offer("x", tenant="a", band=0, cost=100, now=0.0, max_wait_s=1e9, weight=1.0)
    sent = q.pop(0.0)
    assert sent is not None
    _age(q, 3)
    for i in range(3):
        q.offer(f"a-{i}", tenant="a", band=0, cost=100, now=1.0, max_wait_s=1e9, weight=1.0)
        q.offer(f"b-{i}", tenant="b", band=0, cost=100, now=1.0, max_wait_s=1e9, weight=1.0)
    q.refund(sent, 100, 1.0)  # long past: V has passed its finish tag, nothing moves
    order = []
    while (e := q.pop(2.0)) is not None:
        order.append(e.handle)
    assert order == ["a-0", "b-0", "a-1", "b-1", "a-2", "b-2"], order
