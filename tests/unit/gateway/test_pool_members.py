"""Replicas that come and go through discovery: one replica (host:port) belongs to one pool,
and a replica listed again while it still drains starts fresh. Real `Pools` and `Replica`s
(their clocks are passed in)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gateway.config import load_config
from gateway.pool import Pools

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


def _pools(pools: dict[str, Any]) -> Pools:
    return Pools(load_config("", overrides={"pools": pools, "models": {}}, quick=True))


async def test_a_discovered_replica_of_another_pool_is_refused_until_that_pool_lets_it_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A static pool and a discovered one naming the same host:port had two replica objects
    for one engine: two in-flight counts, one of them never scraped again (scrapes are keyed
    by host:port), with no error. The discovered pool is refused it, says why, and gets it
    once the other pool no longer has it."""
    dns = {"dns": {"name": "vllm.svc", "port": 8000}}
    pools = _pools({"s": {"replicas": [A]}, "d": {"discovery": dns}})
    try:
        with caplog.at_level(logging.ERROR, logger="gateway.pool"):
            changes = pools.set_discovered("d", frozenset({A, B}))
        assert [r.url for r in pools.by_name["d"].replicas] == [B]
        assert [r.url for r in changes.added] == [B]
        assert [(r.getMessage(), r.__dict__["owner"]) for r in caplog.records] == [
            ("replica not added: it is a replica of another pool already (a replica belongs "
             "to one pool)", "s")]
        assert [r.pool for r in pools.replicas() if r.url == A] == ["s"]

        pools.set_discovered("d", frozenset({A}))  # only the refused one: nothing of its own
        assert pools.not_ready(0.0)["d"] == (
            "no replica listed or discovered of its own (10.0.0.1:8000: a replica of pool s)")

        doc = load_config("", overrides={"pools": {"s": {"replicas": [B]}, "d": {
            "discovery": dns}}, "models": {}}, quick=True).policy_doc()
        changes = pools.apply(doc)  # the static pool lets it go: the discovered one takes it
        assert [r.url for r in pools.by_name["d"].replicas] == [A]
        assert {(r.pool, r.url) for r in changes.added} == {("s", B), ("d", A)}
        assert [(r.pool, r.url) for r in changes.removed] == [("s", A)]
        assert not pools.by_name["d"].refused
    finally:
        await pools.close()


async def test_a_policy_moving_a_replica_between_pools_moves_it_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The pool it joins comes first in the document: it is refused the replica until the
    pool it leaves lets it go, in the same change; nothing is logged."""
    pools = _pools({"b": {"replicas": [B]}, "a": {"replicas": [A]}})
    try:
        doc = load_config("", overrides={"pools": {"b": {"replicas": [A, B]}, "a": {
            "replicas": [C]}}, "models": {}}, quick=True).policy_doc()
        with caplog.at_level(logging.ERROR, logger="gateway.pool"):
            changes = pools.apply(doc)
        assert not caplog.records
        assert sorted(r.url for r in pools.by_name["b"].replicas) == [A, B]
        assert {(r.pool, r.url) for r in changes.added} == {("b", A), ("a", C)}
        assert [(r.pool, r.url) for r in changes.removed] == [("a", A)]
    finally:
        await pools.close()


async def test_two_discovered_pools_never_share_a_replica() -> None:
    dns = {"dns": {"name": "vllm.svc", "port": 8000}}
    pools = _pools({"d1": {"discovery": dns}, "d2": {"discovery": dns}})
    try:
        pools.set_discovered("d1", frozenset({A}))
        pools.set_discovered("d2", frozenset({A, B}))
        assert {r.id: r.pool for r in pools.replicas()} == {
            "10.0.0.1:8000": "d1", "10.0.0.2:8000": "d2"}
        changes = pools.set_discovered("d1", frozenset())  # d1 lets it go: d2 takes it
        assert [(r.pool, r.url) for r in changes.added] == [("d2", A)]
        assert sorted(r.url for r in pools.by_name["d2"].replicas) == [A, B]
    finally:
        await pools.close()


async def test_a_replica_listed_again_while_it_drains_starts_fresh() -> None:
    """A replica ejected time and again, removed by discovery while a request was still in
    flight there (so it drained), then listed again (a pod's readiness probe flapping) kept
    its ejection: out for the rest of a back-off doubled by each ejection before, up to
    `eject_max_s`. It starts as a new replica would: available at once, its old failures
    forgotten, and the request it still holds from before neither lost nor judged."""
    dns = {"dns": {"name": "vllm.svc", "port": 8000}}
    pools = _pools({"d": {"discovery": dns}})
    try:
        pools.set_discovered("d", frozenset({A}))
        r = pools.by_name["d"].replicas[0]
        held = r.acquire(10, now=0.0)
        now = 0.0
        for _ in range(4):  # ejected four times: the last back-off 8 s
            now = r.ejected_until
            r.mark_down(now)
        assert not r.available(now + 1.0)
        pools.set_discovered("d", frozenset())  # left the pool: drains (a request held)
        assert pools.draining == [r]
        pools.set_discovered("d", frozenset({A}))  # listed again
        assert pools.by_name["d"].replicas == [r] and not r.draining and not pools.draining
        assert r.available(now + 1.0) and r.view(now + 1.0).healthy
        assert r.inflight == 1
        held.release()  # a request from before: counted, not its trial
        assert r.inflight == 0 and r.state == "healthy"
        r.record_failure(now + 2.0)  # one failure is not an ejection (threshold 3)
        assert r.available(now + 2.0)
    finally:
        await pools.close()
