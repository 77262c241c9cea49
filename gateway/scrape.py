"""Scrape vLLM replicas' Prometheus ``/metrics``: an asyncio poller over the pure parser of
`gateway.vllm_page` (`parse_vllm_metrics`, `Sample`, re-exported here).

`Scraper` polls every target in its own task (so a hanging ``/metrics`` delays only itself),
with a timeout over the whole request, jittered intervals, and hands each outcome to
``on_sample(replica_id, sample_or_None, now)``. The app's lifespan owns it: `start`, `stop`.
A page is read up to `MAX_PAGE_BYTES` (vLLM's is tens of KB per data-parallel engine; a
larger one is a failed scrape, read no further) and, past 64 KiB, parsed in a worker thread: a
page of megabytes costs a second of CPU, which on the event loop held every request that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from gateway.transport import read_at_most
from gateway.vllm_page import NoLoadData, Sample, parse_vllm_metrics

__all__ = ["MAX_PAGE_BYTES", "NoLoadData", "Sample", "Scraper", "parse_vllm_metrics"]

log = logging.getLogger(__name__)

OnSample = Callable[[str, Sample | None, float], None]
MAX_PAGE_BYTES = 8 << 20
# a page this small is parsed on the event loop: a few ms even if every line is a series read,
# where a worker thread costs ~0.1 ms of CPU per scrape (4 a second per replica)
_INLINE_BYTES = 64 << 10
_PLAIN = {"Accept-Encoding": "identity"}  # vLLM would gzip every page, 4 times a second


# failed scrapes in a row before the replica's unreadable /metrics is warned about (once per
# run of failures): one late or refused page is no news, a /metrics that answers 404 is
_WARN_AFTER = 3


@dataclass(slots=True)
class _Target:
    url: str
    task: asyncio.Task[None] | None = None
    last_ok: float | None = None
    errors: int = 0
    no_load_data: bool = False  # the last page had no vllm:* series
    failing: int = 0  # failed scrapes in a row (NoLoadData aside: warned about on its own)
    answered: bool = False  # the last scrape read a page, load data or none: it is alive


async def _read_page(r: aiohttp.ClientResponse) -> bytes:
    """The body, or ValueError as soon as it passes `MAX_PAGE_BYTES` (nothing more is read)."""
    if (r.content_length or 0) > MAX_PAGE_BYTES:
        raise ValueError(f"/metrics page of {r.content_length} bytes")
    page = await read_at_most(r.content, MAX_PAGE_BYTES)
    if len(page) > MAX_PAGE_BYTES:
        raise ValueError(f"/metrics page over {MAX_PAGE_BYTES} bytes")
    return page


def _parse_page(page: bytes) -> Sample:
    return parse_vllm_metrics(page.decode())  # the text format is UTF-8 (a ValueError if not)


class Scraper:
    """Polls each target's ``/metrics`` concurrently; reports every outcome to ``on_sample``."""

    def __init__(
        self,
        client: aiohttp.ClientSession,
        on_sample: OnSample,
        *,
        interval_s: float = 0.25,
        timeout_s: float = 1.0,
        jitter: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self._client = client
        self._on_sample = on_sample
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.jitter = jitter
        self._clock = clock
        self._rng = rng or random.Random()
        self._targets: dict[str, _Target] = {}
        self._running = False

    # -- targets ------------------------------------------------------------------------------
    def add_target(self, replica_id: str, base_url: str) -> None:
        """Scrape ``base_url``/metrics as ``replica_id`` (replaces an existing target)."""
        self.remove_target(replica_id)
        target = self._targets[replica_id] = _Target(base_url.rstrip("/") + "/metrics")
        if self._running:
            target.task = asyncio.create_task(self._loop(replica_id, target))

    def remove_target(self, replica_id: str) -> None:
        target = self._targets.pop(replica_id, None)
        if target is not None and target.task is not None:
            target.task.cancel()

    def targets(self) -> Iterable[str]:
        return tuple(self._targets)

    def scrape_age(self, replica_id: str, now: float | None = None) -> float | None:
        """Seconds since the last good scrape of ``replica_id`` (None: never scraped)."""
        target = self._targets.get(replica_id)
        if target is None or target.last_ok is None:
            return None
        return (self._clock() if now is None else now) - target.last_ok

    def errors(self, replica_id: str) -> int:
        target = self._targets.get(replica_id)
        return target.errors if target is not None else 0

    def answered(self, replica_id: str) -> bool:
        """Did its last scrape read a page (one without vllm:* series too)?"""
        target = self._targets.get(replica_id)
        return target is not None and target.answered

    def no_load_data(self, replica_id: str) -> bool:
        """Whether the replica's last page had no ``vllm:`` series (``--disable-log-stats``)."""
        target = self._targets.get(replica_id)
        return target is not None and target.no_load_data

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        self._running = True
        for rid, target in self._targets.items():
            if target.task is None:
                target.task = asyncio.create_task(self._loop(rid, target))

    async def stop(self) -> None:
        self._running = False
        tasks = [t.task for t in self._targets.values() if t.task is not None]
        for target in self._targets.values():
            target.task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def __aenter__(self) -> Scraper:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- polling ------------------------------------------------------------------------------
    async def scrape_once(self, replica_id: str) -> Sample | None:
        """Scrape one target now; reports the outcome and returns it."""
        target = self._targets.get(replica_id)
        if target is None:
            return None
        return await self._scrape(replica_id, target)

    async def _scrape(self, replica_id: str, target: _Target) -> Sample | None:
        sample: Sample | None = None
        try:
            async with asyncio.timeout(self.timeout_s), self._client.get(
                target.url, headers=_PLAIN,
            ) as r:
                if r.status != 200:
                    raise ValueError(f"/metrics answered {r.status}")
                page = await _read_page(r)
            sample = (_parse_page(page) if len(page) <= _INLINE_BYTES
                      else await asyncio.to_thread(_parse_page, page))
            target.no_load_data = False
            target.answered = True
        except NoLoadData:
            target.answered = True
            target.errors += 1
            if not target.no_load_data:
                log.warning("replica exports no vllm:* metrics (--disable-log-stats?): "
                            "routing on kvgate's own accounting", extra={"replica": replica_id})
            target.no_load_data = True
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            target.answered = False
            target.errors += 1
            log.debug("scrape failed", extra={"replica": replica_id, "error": type(exc).__name__})
            self._failed(replica_id, target, exc)
        now = self._clock()
        if sample is not None:
            target.last_ok = now
            if target.failing >= _WARN_AFTER:
                log.info("replica's /metrics read again", extra={"replica": replica_id})
            target.failing = 0
        if self._targets.get(replica_id) is target:
            try:
                self._on_sample(replica_id, sample, now)
            except Exception:  # a faulty consumer must not stop the poller
                log.exception("on_sample failed", extra={"replica": replica_id})
        return sample

    def _failed(self, replica_id: str, target: _Target, exc: Exception) -> None:
        """One warning per run of failed scrapes (a /metrics that answers 404 behind a proxy
        routing /v1 only, one too slow for the scrape timeout, an unreadable page): the
        router works without the replica's load then, and an operator was told nothing."""
        target.failing += 1
        if target.failing != _WARN_AFTER:
            return
        if isinstance(exc, TimeoutError):
            why = f"no answer within {self.timeout_s:g} s"
        elif isinstance(exc, aiohttp.ClientError):
            why = type(exc).__name__
        else:
            why = str(exc)[:120]
        log.warning("replica's /metrics cannot be read (%s): routing there on kvgate's own "
                    "accounting until it can", why, extra={"replica": replica_id})

    async def _loop(self, replica_id: str, target: _Target) -> None:
        while True:
            started = self._clock()
            try:
                await self._scrape(replica_id, target)
            except Exception:  # a page no rule foresaw must not end this replica's polling
                target.errors += 1
                log.exception("scrape failed", extra={"replica": replica_id})
            spread = self.interval_s * self.jitter
            delay = self.interval_s + self._rng.uniform(-spread, spread)
            await asyncio.sleep(max(0.0, delay - (self._clock() - started)))
