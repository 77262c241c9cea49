"""A dual-stack Service lists each pod once: by its IPv4 address.

Such a Service has an EndpointSlice per address family (and its headless name resolves to
both an A and an AAAA record per pod); both were taken, so each vLLM pod was two replicas:
its in-flight load and prefix affinity split between two entries, its capacity counted twice
(and vLLM listens on IPv4 unless told otherwise: the IPv6 entry was down). A single-stack
IPv6 Service keeps its addresses."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.discovery.config import DnsConfig
from gateway.discovery.dns import DnsDiscovery
from gateway.discovery.slices import urls_from_slices

PORTS = [{"name": "http", "port": 8000}]


def _slice(family: str, *addresses: str) -> dict[str, Any]:
    return {"addressType": family, "ports": PORTS,
            "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses]}


def test_a_dual_stack_service_lists_each_pod_once() -> None:
    slices = [_slice("IPv4", "10.0.0.1", "10.0.0.2"), _slice("IPv6", "fd00::1", "fd00::2")]
    assert urls_from_slices(slices, "http", "http") == {"http://10.0.0.1:8000",
                                                        "http://10.0.0.2:8000"}


def test_a_single_stack_service_keeps_its_family() -> None:
    v6 = [_slice("IPv6", "fd00::1"), _slice("IPv6", "fd00::2")]
    assert urls_from_slices(v6, "http", "http") == {"http://[fd00::1]:8000",
                                                    "http://[fd00::2]:8000"}
    v4 = [_slice("IPv4", "10.0.0.1"), _slice("IPv4", "10.0.0.2")]
    assert urls_from_slices(v4, "http", "http") == {"http://10.0.0.1:8000",
                                                    "http://10.0.0.2:8000"}


def _dns_set(addresses: list[str]) -> frozenset[str]:
    """What DNS discovery publishes when the name resolves to `addresses` (a resolver
    scripted through its seam: no real one answers a dual-stack name on demand)."""
    published: list[frozenset[str]] = []

    async def run() -> None:
        async def resolver(host: str, port: int) -> list[str]:
            return addresses

        watcher = DnsDiscovery("p", DnsConfig(name="vllm.llm.svc", port=8000),
                               lambda _, urls: published.append(urls), resolver=resolver)
        await watcher.start()
        try:
            async with asyncio.timeout(10):
                await watcher.wait_synced()
        finally:
            await watcher.stop()

    asyncio.run(run())
    return published[0]


def test_a_dual_stack_name_lists_each_pod_once() -> None:
    both = ["fd00::1", "10.0.0.1", "fd00::2", "10.0.0.2"]
    assert _dns_set(both) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
    assert _dns_set(["fd00::1", "fd00::2"]) == {"http://[fd00::1]:8000", "http://[fd00::2]:8000"}
