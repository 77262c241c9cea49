"""A discovery source is heard only while the policy in force gives its pool the mapping it
was built from: a policy version is applied at once, its sources are stopped in a task a
moment later, and a set a stopped-to-be source published meanwhile re-listed a pool the new
version had just listed itself (kept so until the next version). A real `DiscoveryManager`
and `DnsDiscovery` sources on a scripted resolver (the addresses the test sets)."""

from __future__ import annotations

import asyncio

from gateway.discovery import DiscoveryManager, DnsDiscovery, parse_discovery
from gateway.discovery.base import OnChange
from gateway.discovery.config import DnsConfig
from gateway.policy_doc import PoolConfig

DNS = {"dns": {"name": "vllm.svc", "port": 8000, "interval_seconds": 0.01}}


async def test_a_source_whose_pool_left_discovery_is_not_heard() -> None:
    addresses = ["10.0.0.1"]
    heard: list[tuple[str, set[str]]] = []

    async def resolve(host: str, port: int) -> list[str]:
        return list(addresses)

    def build(pool: str, raw: dict[str, dict[str, object]], on_change: OnChange) -> DnsDiscovery:
        config = parse_discovery(raw)
        assert isinstance(config, DnsConfig)
        return DnsDiscovery(pool, config, on_change, resolver=resolve)

    manager = DiscoveryManager(build, lambda pool, urls: heard.append((pool, set(urls))))
    discovered = {"p": PoolConfig(discovery=DNS)}
    manager.expect(discovered)
    await manager.sync(discovered)
    try:
        assert await manager.wait_synced(5) == []
        assert heard == [("p", {"http://10.0.0.1:8000"})]
        # a policy version lists the pool's replicas: in force at once; its source runs on
        # until the manager follows the version (a task, later)
        manager.expect({"p": PoolConfig(replicas=["http://10.0.0.9:8000"])})
        addresses[:] = ["10.0.0.2"]
        await asyncio.sleep(0.2)  # the source resolves the new address meanwhile
        assert heard == [("p", {"http://10.0.0.1:8000"})]
        # back to discovery: its new source is heard
        manager.expect(discovered)
        await manager.sync({"p": PoolConfig(replicas=["http://10.0.0.9:8000"])})
        await manager.sync(discovered)
        assert await manager.wait_synced(5) == []
        assert heard[-1] == ("p", {"http://10.0.0.2:8000"})
    finally:
        await manager.stop()
