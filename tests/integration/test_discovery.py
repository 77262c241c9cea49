"""Discovery against real sockets: a small fake Kubernetes API on 127.0.0.1, and real DNS
lookups of names that resolve locally (no query leaves the machine)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.discovery import (
    DnsConfig,
    DnsDiscovery,
    KubernetesConfig,
    KubernetesDiscovery,
    build_discovery,
)
from tests.support.fake_kube import (
    NAMESPACE,
    SERVICE,
    TOKEN,
    FakeKube,
    endpoint,
    eps,
)


class Changes:
    """Records on_change calls; `next()` awaits the next one (with a failure deadline)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, frozenset[str]]] = asyncio.Queue()

    def __call__(self, pool: str, urls: frozenset[str]) -> None:
        self.queue.put_nowait((pool, urls))

    async def next(self) -> frozenset[str]:
        async with asyncio.timeout(10):
            pool, urls = await self.queue.get()
        assert pool == "fp8"
        return urls


def k8s_config(api: str, tmp_path: Path, **extra: Any) -> KubernetesConfig:
    token = tmp_path / "token"
    if not token.exists():
        token.write_text(TOKEN + "\n")
    return KubernetesConfig(service=SERVICE, namespace=NAMESPACE, api_server=api,
                            token_path=str(token), ca_path=None, **extra)


U = "http://10.0.0.{}:8000".format


async def test_list_then_watch_follows_ready_endpoints(kube: tuple[FakeKube, str],
                                                       tmp_path: Path) -> None:
    fake, api = kube
    fake.put(eps("a", endpoint("10.0.0.1"), endpoint("10.0.0.2", False),
                 endpoint("10.0.0.3", None)), event=None)
    changes = Changes()
    source = KubernetesDiscovery("fp8", k8s_config(api, tmp_path), changes)
    await source.start()
    try:
        assert await changes.next() == {U(1), U(3)}  # not-ready .2 left out, unset = ready
        await fake.watching()
        fake.put(eps("a", endpoint("10.0.0.1"), endpoint("10.0.0.2"), endpoint("10.0.0.3")))
        assert await changes.next() == {U(1), U(2), U(3)}
        fake.put(eps("b", endpoint("10.0.0.9")), event="ADDED")
        assert await changes.next() == {U(1), U(2), U(3), U(9)}
        # A change that leaves the set as it is must not call on_change ...
        fake.put(eps("b", endpoint("10.0.0.9"), endpoint("10.0.0.8", False)))
        fake.delete("a")
        # ... so the next call is the deletion.
        assert await changes.next() == {U(9)}
        assert source.urls == {U(9)}
        assert fake.lists == 1
    finally:
        await source.stop()


@pytest.mark.parametrize("as_event", [False, True], ids=["http-410", "error-event-410"])
async def test_gone_relists(kube: tuple[FakeKube, str], tmp_path: Path, as_event: bool,
                            caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.discovery")
    fake, api = kube
    fake.put(eps("a", endpoint("10.0.0.1")), event=None)
    changes = Changes()
    source = KubernetesDiscovery("fp8", k8s_config(api, tmp_path), changes)
    await source.start()
    try:
        assert await changes.next() == {U(1)}
        await fake.watching()
        fake.put(eps("a", endpoint("10.0.0.1"), endpoint("10.0.0.5")), event=None)
        fake.expire(as_event=as_event)
        assert await changes.next() == {U(1), U(5)}
        assert fake.lists == 2
        # 410 is the protocol's normal "re-list" signal, not a failure to back off from.
        assert "re-listing" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        await source.stop()


async def test_periodic_resync_catches_a_missed_event(kube: tuple[FakeKube, str],
                                                      tmp_path: Path) -> None:
    fake, api = kube
    fake.put(eps("a", endpoint("10.0.0.1")), event=None)
    changes = Changes()
    config = k8s_config(api, tmp_path, resync_seconds=0.2)
    source = KubernetesDiscovery("fp8", config, changes)
    await source.start()
    try:
        assert await changes.next() == {U(1)}
        fake.put(eps("a", endpoint("10.0.0.4")), event=None)  # no watch ever hears of it
        assert await changes.next() == {U(4)}
        assert fake.lists >= 2
    finally:
        await source.stop()


async def test_token_is_reread_so_rotation_recovers(kube: tuple[FakeKube, str],
                                                    tmp_path: Path) -> None:
    fake, api = kube
    fake.put(eps("a", endpoint("10.0.0.1")), event=None)
    (tmp_path / "token").write_text("expired-token")
    changes = Changes()
    config = k8s_config(api, tmp_path, backoff_max_seconds=0.2)
    source = KubernetesDiscovery("fp8", config, changes)
    await source.start()
    try:
        async with asyncio.timeout(10):
            for _ in range(2):  # it retries, and publishes nothing meanwhile
                await fake.unauthorized.get()
        assert changes.queue.empty()
        (tmp_path / "token").write_text(TOKEN)
        assert await changes.next() == {U(1)}
    finally:
        await source.stop()


@pytest.mark.parametrize(("port", "expected"), [
    ("http", {U(1)}),  # slice b carries no port named http
    ("metrics", {"http://10.0.0.1:9000", "http://10.0.0.2:9000"}),
])
async def test_port_by_name_and_namespace_from_file(kube: tuple[FakeKube, str], tmp_path: Path,
                                                    port: str, expected: set[str]) -> None:
    fake, api = kube
    fake.put(eps("a", endpoint("10.0.0.1")), event=None)
    fake.put(eps("b", endpoint("10.0.0.2"), port_name="grpc"), event=None)
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "namespace").write_text(NAMESPACE + "\n")
    changes = Changes()
    raw: dict[str, dict[str, object]] = {"kubernetes": {
        "service": SERVICE, "port": port, "api_server": api,
        "token_path": str(tmp_path / "token"), "namespace_path": str(tmp_path / "namespace")}}
    source = build_discovery("fp8", raw, changes, env={})
    await source.start()
    try:
        assert await changes.next() == expected
    finally:
        await source.stop()


async def test_dns_localhost_resolves_to_loopback() -> None:
    changes = Changes()
    source = DnsDiscovery("fp8", DnsConfig(name="localhost", port=8000), changes)
    await source.start()
    try:
        urls = await changes.next()
        assert "http://127.0.0.1:8000" in urls or "http://[::1]:8000" in urls
        assert urls <= {"http://127.0.0.1:8000", "http://[::1]:8000"}
    finally:
        await source.stop()


async def test_dns_numeric_name_and_change_detection() -> None:
    script: Iterator[list[str] | OSError] = itertools.chain(
        [["127.0.0.1"], ["127.0.0.1"], OSError("lookup failed"), ["127.0.0.1", "127.0.0.2"]],
        itertools.repeat(["127.0.0.2"]),
    )

    async def resolver(host: str, port: int) -> list[str]:
        step = next(script)
        if isinstance(step, OSError):
            raise step
        return step

    changes = Changes()
    config = DnsConfig(name="pool.example", port=8001, interval_seconds=0.01)
    source = DnsDiscovery("fp8", config, changes, resolver=resolver)
    await source.start()
    try:
        # Repeats and the failed lookup publish nothing; the set changes twice.
        assert await changes.next() == {"http://127.0.0.1:8001"}
        assert await changes.next() == {"http://127.0.0.1:8001", "http://127.0.0.2:8001"}
        assert await changes.next() == {"http://127.0.0.2:8001"}
    finally:
        await source.stop()


async def test_dns_real_getaddrinfo_for_a_numeric_address() -> None:
    changes = Changes()
    source = build_discovery("fp8", {"dns": {"name": "127.0.0.1", "port": 8002}}, changes)
    await source.start()
    try:
        assert await changes.next() == {"http://127.0.0.1:8002"}
        await source.wait_synced()
    finally:
        await source.stop()
