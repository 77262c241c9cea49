"""`/metrics` of a gateway running `server.workers` > 1: every worker's series in one answer.

The workers share the port, so a scrape reaches one of them at random; left alone each would
answer with its own counters only, and a counter would jump between the workers' values from
one scrape to the next. Instead every worker writes its exposition to a file of its own (in a
directory the supervisor made and removes) once a second, and the worker a scrape reaches
writes its own at once and answers with every worker's file, every sample labelled
``worker="<slot>"``. Files only ever get newer, so counters stay monotonic per series whichever
worker each scrape reaches; ``sum without (worker)`` gives the gateway's totals. A file older
than `STALE_AFTER_S` (a worker that stopped or hangs) is left out; a restarted worker takes
over its slot's series (a counter reset, which Prometheus handles).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

__all__ = ["STALE_AFTER_S", "WorkerExposition", "WorkerSlot", "current", "merge", "set_current"]

log = logging.getLogger(__name__)

WRITE_INTERVAL_S = 1.0
STALE_AFTER_S = 10.0
WORKER_LABEL = "worker"


@dataclass(frozen=True)
class WorkerSlot:
    """This process is worker ``slot`` of a supervisor that shares ``directory``."""

    slot: int
    directory: Path


_current: WorkerSlot | None = None


def set_current(slot: WorkerSlot) -> None:
    """Called once in a worker process, before its gateway starts (`gateway.workers`)."""
    global _current
    _current = slot


def current() -> WorkerSlot | None:
    """The worker slot of this process; None for a gateway of one process."""
    return _current


class WorkerExposition:
    """One worker's part: publishes its exposition and answers scrapes with everyone's."""

    def __init__(
        self, slot: WorkerSlot, own: Callable[[], bytes],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.slot = slot
        self._own = own
        self._clock = clock  # wall clock: compared with the files' mtimes

    def _path(self, slot: int) -> Path:
        return self.slot.directory / f"worker-{slot}.prom"

    def publish(self) -> None:
        self._write(self._own())

    def _write(self, text: bytes) -> None:
        path = self._path(self.slot.slot)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(text)
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one

    async def run(self) -> None:
        while True:
            try:
                self.publish()
            except OSError as exc:  # a full or removed directory: say so, keep serving
                log.warning("cannot write this worker's metrics", extra={"error": str(exc)})
            await asyncio.sleep(WRITE_INTERVAL_S)

    def remove(self) -> None:
        self._path(self.slot.slot).unlink(missing_ok=True)

    def render(self) -> bytes:
        """Every live worker's series. This worker's are written out first and served as
        written: a later scrape reaching another worker reads at least these values, so no
        counter goes back when consecutive scrapes reach different workers."""
        own = self._own()
        texts = {self.slot.slot: own.decode()}
        with contextlib.suppress(OSError):  # its own series still answer (the writer logs)
            self._write(own)
        now = self._clock()
        for path in self.slot.directory.glob("worker-*.prom"):
            slot = _slot_of(path)
            if slot is None or slot == self.slot.slot:
                continue
            try:
                if now - path.stat().st_mtime > STALE_AFTER_S:
                    continue
                texts[slot] = path.read_text()
            except OSError:  # removed between the listing and the read: that worker stopped
                continue
        return merge(texts)


def _slot_of(path: Path) -> int | None:
    digits = path.stem.removeprefix("worker-")
    return int(digits) if digits.isdigit() else None


def merge(texts: Mapping[int, str]) -> bytes:
    """Prometheus text expositions by worker slot -> one exposition, samples labelled."""
    families: dict[str, Metric] = {}
    for slot in sorted(texts):
        for family in text_string_to_metric_families(texts[slot]):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit)
            label = str(slot)
            merged.samples.extend(
                Sample(s.name, {**s.labels, WORKER_LABEL: label}, s.value, s.timestamp)
                for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families
