"""Replicas and pools that come and go leave nothing behind: a drained replica's
`kvgate_requests_total` series and a removed pool's transport are forgotten `linger_s` after
they drained (a fleet that gets a new pod address at every rollout kept them all)."""

from __future__ import annotations

from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import load_config
from gateway.membership import Membership
from gateway.metrics import GatewayMetrics
from gateway.pool import Pools
from gateway.scrape import Scraper
from gateway.tenancy import PolicySnapshot
from routing.router import Router

LINGER_S = 30.0


def _cfg(pools: dict[str, Any]) -> Any:
    return load_config("", overrides={"pools": pools, "models": {}}, quick=True)


def _requests_series(metrics: GatewayMetrics) -> set[str]:
    return {s.labels["replica"]
            for f in text_string_to_metric_families(metrics.render().decode())
            if f.name == "kvgate_requests" for s in f.samples}


class _Fleet:
    def __init__(self, cfg: Any, session: aiohttp.ClientSession) -> None:
        self.now = 0.0
        self.pools = Pools(cfg)
        self.metrics = GatewayMetrics(self.pools.described, lambda: self.now)
        by_id = {r.id: r for r in self.pools.replicas()}
        scraper = Scraper(session, lambda *_: None)
        self.members = Membership(self.pools, by_id, Router(cfg.routing.router_config()),
                                  scraper, None, self.metrics, lambda: self.now, LINGER_S)


async def test_a_drained_replicas_series_go_after_the_linger() -> None:
    async with aiohttp.ClientSession() as session:
        fleet = _Fleet(_cfg({"p": {"replicas": ["http://r:65000"]}}), session)
        for i in range(1, 201):  # a new replica address every second, each served once
            fleet.members.discovered("p", frozenset({f"http://r:{i}"}))
            fleet.metrics.finished("p", f"r:{i}", 200, "round-robin", 0.01)
            await fleet.members.reap_once()
            fleet.now += 1.0
        kept = _requests_series(fleet.metrics)
        assert "r:200" in kept and len(kept) <= LINGER_S + 2  # the last half minute's only
        fleet.now += LINGER_S
        await fleet.members.reap_once()
        assert _requests_series(fleet.metrics) == {"r:200"}
        await fleet.pools.close()


async def test_a_replica_back_before_the_linger_ends_keeps_its_series() -> None:
    async with aiohttp.ClientSession() as session:
        fleet = _Fleet(_cfg({"p": {"replicas": ["http://r:1"]}}), session)
        fleet.metrics.finished("p", "r:1", 200, "round-robin", 0.01)
        fleet.members.discovered("p", frozenset())
        await fleet.members.reap_once()  # drained: forgotten in LINGER_S
        fleet.members.discovered("p", frozenset({"http://r:1"}))  # back
        fleet.now += LINGER_S
        await fleet.members.reap_once()
        assert _requests_series(fleet.metrics) == {"r:1"}
        await fleet.pools.close()


async def test_a_removed_pool_is_closed_and_forgotten_after_the_linger() -> None:
    async with aiohttp.ClientSession() as session:
        cfg = _cfg({"p": {"replicas": ["http://r:1"]}})
        fleet = _Fleet(cfg, session)
        removed = []
        for i in range(50):  # a policy version adds a pool, the next one removes it
            doc = _cfg({"p": {"replicas": ["http://r:1"]},
                        f"q{i}": {"replicas": [f"http://q:{i + 1}"]}}).policy_doc()
            fleet.members.policy_changed(PolicySnapshot(2 * i, doc))
            removed.append(fleet.pools.by_name[f"q{i}"])
            fleet.members.policy_changed(PolicySnapshot(2 * i + 1, cfg.policy_doc()))
            await fleet.members.reap_once()
            fleet.now += 1.0
        assert len(fleet.pools.retired) <= LINGER_S + 1
        fleet.now += LINGER_S
        await fleet.members.reap_once()
        assert fleet.pools.retired == []
        assert all(pool.transport.closed for pool in removed)
        await fleet.members.stop()
        await fleet.pools.close()
