"""DNS discovery of a name the resolver refuses before any lookup (a label over 63 characters:
`UnicodeError` from the IDNA encoding, not the `OSError` of a failed lookup) keeps polling and
says why, as for a failed lookup. Before, the exception ended the watcher's task without a
word: the pool stayed `discovery not synced yet` forever, even once the policy was fixed by a
version that kept the same source."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.discovery.config import DnsConfig
from gateway.discovery.dns import DnsDiscovery, resolve_addresses

BAD_NAME = "a" * 64 + ".invalid"  # refused by the IDNA codec: nothing is asked of any resolver


def test_a_name_the_resolver_refuses_keeps_the_watcher_polling(
    caplog: pytest.LogCaptureFixture,
) -> None:
    published: list[frozenset[str]] = []

    async def run() -> None:
        asked = asyncio.Semaphore(0)

        async def resolver(host: str, port: int) -> list[str]:
            asked.release()  # counts the tries; the real resolver answers them
            return await resolve_addresses(host, port)

        cfg = DnsConfig(name=BAD_NAME, port=8000, interval_seconds=0.01)
        watcher = DnsDiscovery("p", cfg, lambda _, urls: published.append(urls),
                               resolver=resolver)
        await watcher.start()
        try:
            async with asyncio.timeout(10):
                for _ in range(3):  # tried again and again: the task lives on
                    await asyncio.wait_for(asked.acquire(), timeout=10)
            assert not watcher.synced
        finally:
            await watcher.stop()

    with caplog.at_level(logging.WARNING):
        asyncio.run(run())
    assert published == []
    warned = [r for r in caplog.records if r.getMessage().startswith("dns discovery failed")]
    assert warned and "idna" in getattr(warned[0], "error", "")  # the codec says why
