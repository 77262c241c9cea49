"""What every discovery source shares: the owned task, change detection, first-sync event."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

__all__ = ["OnChange", "WatcherBase", "format_url"]

# Called with (pool name, the complete current set of replica URLs). Synchronous on purpose:
# it runs on the event loop and must only record the new set (the gateway schedules any
# slow work, e.g. draining a removed replica, in its own tasks).
OnChange = Callable[[str, frozenset[str]], None]

log = logging.getLogger(__name__)


def format_url(scheme: str, host: str, port: int) -> str:
    """``scheme://host:port`` with IPv6 literals bracketed (RFC 3986)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


class WatcherBase:
    """A background task that publishes the pool's replica set when it changes.

    ``start()`` creates the task on the running loop; ``stop()`` cancels and awaits it.
    ``on_change`` is first called after the first successful sync (even with an empty set,
    so the caller learns discovery works), then only when the set differs from the last one.
    """

    def __init__(self, pool: str, on_change: OnChange) -> None:
        self.pool = pool
        self._on_change = on_change
        self._urls: frozenset[str] | None = None
        self._synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def urls(self) -> frozenset[str]:
        """The last published set (empty before the first sync)."""
        return self._urls or frozenset()

    @property
    def synced(self) -> bool:
        """True once the first set was published."""
        return self._synced.is_set()

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"discovery for pool {self.pool!r} already started")
        self._task = asyncio.create_task(self._run(), name=f"discovery:{self.pool}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._close()

    async def wait_synced(self) -> None:
        """Return once the first set was published (wrap in asyncio.timeout as needed)."""
        await self._synced.wait()

    def _publish(self, urls: frozenset[str]) -> None:
        first = not self._synced.is_set()
        self._synced.set()
        if urls == self._urls:
            return
        self._urls = urls
        log.info(
            "discovery changed",
            extra={"pool": self.pool, "replicas": len(urls), "first_sync": first},
        )
        try:
            self._on_change(self.pool, urls)
        except Exception:
            # A faulty callback must not kill discovery; the next change retries it.
            log.exception("discovery on_change failed", extra={"pool": self.pool})

    async def _run(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def _close(self) -> None:
        """Release resources after the task ended (overridden where needed)."""
