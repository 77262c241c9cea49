"""One discovery source per pool that has `discovery`, following the policy in force.

The gateway's lifespan owns a `DiscoveryManager`: `sync(pools)` starts sources for pools that
gained a `discovery` mapping, restarts those whose mapping changed and stops those of pools
that lost it (or vanished); `stop()` stops them all. Every source reports to the same
`on_change(pool, urls)`, while the policy in force (`expect`) still gives the pool the mapping
that source was built from.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Protocol

import orjson

from gateway.discovery.base import OnChange, WatcherBase
from gateway.discovery.config import DiscoveryConfigError

__all__ = ["DiscoveryManager", "PoolDiscovery"]

log = logging.getLogger(__name__)


class PoolDiscovery(Protocol):
    """The part of a pool's config the manager reads (`gateway.policy_doc.PoolConfig`)."""

    discovery: dict[str, dict[str, object]] | None


class _Builder(Protocol):
    def __call__(
        self, pool: str, raw: dict[str, dict[str, object]], on_change: OnChange
    ) -> WatcherBase: ...


class DiscoveryManager:
    def __init__(self, build: _Builder, on_change: OnChange) -> None:
        self._build = build
        self._on_change = on_change
        self._sources: dict[str, tuple[bytes, WatcherBase]] = {}
        self._wanted: dict[str, bytes] = {}  # pool -> its mapping in force (`expect`)
        self._lock = asyncio.Lock()  # policy versions may arrive faster than sources stop

    @property
    def pools(self) -> frozenset[str]:
        return frozenset(self._sources)

    def expect(self, pools: Mapping[str, PoolDiscovery]) -> None:
        """The policy now in force (called with it, before `sync` follows it): a source
        whose pool no longer has its mapping is not heard from any more, though it runs
        until `sync` stops it -- a set it published meanwhile re-listed a pool the new
        policy had just listed itself (or moved to another source), and kept it so until
        the next policy version."""
        self._wanted = {name: _key(pc.discovery) for name, pc in pools.items() if pc.discovery}

    async def sync(self, pools: Mapping[str, PoolDiscovery], *, strict: bool = False) -> None:
        """Follow `pools`. A bad mapping raises `DiscoveryConfigError` when `strict` (start-up),
        else it is logged and that pool keeps its previous source."""
        async with self._lock:
            wanted = {name: pc.discovery for name, pc in pools.items() if pc.discovery}
            for name in [n for n in self._sources if n not in wanted]:
                await self._stop(name)
            for name, raw in wanted.items():
                key = _key(raw)
                if name in self._sources and self._sources[name][0] == key:
                    continue
                try:
                    source = self._build(name, raw, self._heard(key))
                except DiscoveryConfigError as exc:
                    if strict:
                        raise
                    log.error("discovery config rejected", extra={"pool": name, "error": str(exc)})
                    continue
                await self._stop(name)
                self._sources[name] = (key, source)
                await source.start()
                log.info("discovery started", extra={"pool": name, "mode": next(iter(raw))})

    def _heard(self, key: bytes) -> OnChange:
        """The `on_change` of a source built from mapping `key`: passed on while in force."""
        def heard(pool: str, urls: frozenset[str]) -> None:
            if self._wanted.get(pool) == key:
                self._on_change(pool, urls)
        return heard

    def pending(self, pool: str) -> bool:
        """Pool `pool` has a source that has not published its first set yet."""
        entry = self._sources.get(pool)
        return entry is not None and not entry[1].synced

    async def wait_synced(self, timeout_s: float) -> list[str]:
        """Wait (bounded) for every source's first sync; the pools still unsynced."""
        sources = {name: src for name, (_, src) in self._sources.items()}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(src.wait_synced() for src in sources.values()))
        return [name for name, src in sources.items() if not src.synced]

    async def _stop(self, name: str) -> None:
        entry = self._sources.pop(name, None)
        if entry is not None:
            await entry[1].stop()

    async def stop(self) -> None:
        async with self._lock:
            for name in list(self._sources):
                await self._stop(name)


def _key(raw: dict[str, dict[str, object]]) -> bytes:
    return orjson.dumps(raw, option=orjson.OPT_SORT_KEYS)
