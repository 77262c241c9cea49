"""`/metrics` of a gateway running `server.workers` > 1: every worker's series in one answer.

The workers share the port, so a scrape reaches one of them at random; left alone each would
answer with its own counters only, and a counter would jump between the workers' values from
one scrape to the next. Instead every worker writes its exposition to a file of its own (in a
directory the supervisor made and removes) every second, every sample already labelled
``worker="<slot>"``, and the worker a scrape reaches writes its own at once and answers with
every worker's file, the lines of each family put together (text work only: no parsing of
values, a few ms for a large page). Files only ever get newer, so counters stay monotonic per
series whichever worker each scrape reaches; ``sum without (worker)`` gives the gateway's
totals. A file older than `STALE_AFTER_S` (a worker that stopped or hangs) is left out; a
restarted worker takes over its slot's series (a counter reset, which Prometheus handles).

A worker's whole part can take a while to render (thousands of per-tenant counter series), so
it is rewritten less often on a busy worker (its file touched every second all the same: its
age says the worker lives); the series read at scrape time (in flight, health, queue depth,
Redis's state: a few per pool and replica) are written apart every second all the same, and a
scrape reaching another worker reads them from there: a queue
building in one worker was seen ~3 s late where its whole part took 60 ms to render.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, Metric

__all__ = ["STALE_AFTER_S", "NoRestarts", "WorkerExposition", "WorkerSlot", "current",
           "fold_dead", "label_lines", "merge", "set_current"]

log = logging.getLogger(__name__)

# also written before every answer (monotonicity does not depend on it); every second, so a
# scrape reaching another worker sees this one's series at most a second old (docs/metrics.md),
# unless a write takes more than `WRITE_SHARE` of that: it renders this worker's registry on
# its event loop (~30 us a line: 2,400 series of kvgate_requests_total took 85 ms, labels
# added, on a busy 2-core host), so the whole part's writes are spaced to keep them to that
# share of it; the state part (the series read at scrape time) is written every second still
WRITE_INTERVAL_S = 1.0
WRITE_SHARE = 0.02
POLL_SLACK_S = 0.05  # a whole part due within this of a tick is written at that tick
STALE_AFTER_S = 15.0
WORKER_LABEL = "worker"
RESTARTS = "kvgate_worker_restarts_total"  # kept in each slot's base (`fold_dead`)
RESTARTS_HELP = "workers of this slot that died and were started again"
GENERATION = "# kvgate-worker-generation "  # a part's first line: whose it is (`fold_dead`)


@dataclass(frozen=True)
class WorkerSlot:
    """This process is worker ``slot`` of a supervisor that shares ``directory``."""

    slot: int
    directory: Path
    generation: int = 0  # how many workers held this slot before this one


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
        self, slot: WorkerSlot, own: Callable[[], bytes], state: Callable[[], bytes],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.slot = slot
        self._own = own  # the whole part
        self._state = state  # the series read at scrape time alone
        self._clock = clock  # wall clock: compared with the files' mtimes
        self._written: str | None = None  # the last part written (what the others may read)

    def _path(self, slot: int, kind: str = "prom") -> Path:
        return self.slot.directory / f"worker-{slot}.{kind}"

    def _write(self, text: str, kind: str) -> bool:
        try:
            path = self._path(self.slot.slot, kind)
            tmp = path.with_name(f"{path.name}.tmp")
            tmp.write_text(f"{GENERATION}{self.slot.generation}\n{text}")
            os.replace(tmp, path)  # readers see the old file or the new one, never half
        except OSError as exc:
            log.warning("cannot write this worker's metrics", extra={"error": str(exc)})
            return False
        return True

    def publish(self) -> str:
        """Write this worker's part now, then its state part; return what is in the file
        (the last part written when this write fails: never serve more than the others can
        read, or a counter would go back when the next scrape reaches another worker)."""
        text = label_lines(self._own().decode(), self.slot.slot)
        if not self._write(text, "prom"):
            return self._written if self._written is not None else text
        self._written = text
        self.publish_state()  # never older than the whole part written before it
        return text

    def publish_state(self) -> None:
        self._write(label_lines(self._state().decode(), self.slot.slot), "state")

    async def run(self) -> None:
        whole_due = 0.0
        while True:
            start = time.perf_counter()
            try:
                if start >= whole_due:
                    self.publish()
                    took = time.perf_counter() - start
                    whole_due = start + max(WRITE_INTERVAL_S, took / WRITE_SHARE) - POLL_SLACK_S
                else:
                    self.touch()
                    self.publish_state()
            except Exception:  # a collector that fails: keep the loop (and the others' view)
                log.exception("this worker's metrics could not be rendered")
            await asyncio.sleep(WRITE_INTERVAL_S)

    def touch(self) -> None:
        """This worker lives, though its whole part is not rewritten now: the others judge it
        alive by that part's age (`STALE_AFTER_S`), and a busy worker rewrites it only every
        50 renders' time (0.3 s to render: 15 s, and the others left its series out). Before
        the state part is written, so that the state part stays the newer (`_with_state`)."""
        with contextlib.suppress(OSError):  # (its directory gone: `publish` says so)
            os.utime(self._path(self.slot.slot))

    def remove(self) -> None:
        for kind in ("prom", "state"):
            self._path(self.slot.slot, kind).unlink(missing_ok=True)

    def render(self) -> bytes:
        """Every live worker's series. This worker's are written out first and served as
        written: a later scrape reaching another worker reads at least these values, so no
        counter goes back when consecutive scrapes reach different workers."""
        own = self.slot.slot
        texts = {own: self.publish()}
        bases = {slot: _base(path) for path in self.slot.directory.glob("base-*.prom")
                 if (slot := _slot_of(path)) is not None}
        now = self._clock()
        for path in self.slot.directory.glob("worker-*.prom"):
            slot = _slot_of(path)
            if slot is None or slot == own:
                continue
            try:
                if now - path.stat().st_mtime > STALE_AFTER_S:
                    continue
                text = _with_state(path, self._path(slot, "state"))
            except (OSError, UnicodeDecodeError):  # gone between listing and reading: stopped
                continue
            if _generation(text) > bases.get(slot, ("", -1))[1]:  # not folded in its base yet
                texts[slot] = text
        for slot in texts.keys() | bases.keys():  # each slot's restarts, 0 until one dies
            texts[slot] = add_counters(texts.get(slot, ""),
                                       bases[slot][0] if slot in bases else restarts(slot, 0))
        return merge(texts)


def _with_state(whole_path: Path, state_path: Path) -> str:
    """A worker's whole part with the families of its state part put in their place: the
    state part is rewritten every second, the whole part less often on a busy worker. Only
    a state part written after the whole part (one that failed to be is older: its counters
    could be below the whole part's a scrape of that worker served)."""
    whole_at = whole_path.stat().st_mtime_ns
    whole = whole_path.read_text()
    try:
        if state_path.stat().st_mtime_ns < whole_at:
            return whole
        state = _families(state_path.read_text())
    except (OSError, UnicodeDecodeError):  # none yet, or the worker is stopping
        return whole
    families = _families(whole) | state
    head = whole.split("\n", 1)[0] + "\n" if whole.startswith(GENERATION) else ""
    return head + "".join(f"{line}\n" for meta, lines in families.values()
                          for line in (*meta, *lines))


def _slot_of(path: Path) -> int | None:
    digits = path.stem.split("-", 1)[-1]
    return int(digits) if digits.isdigit() else None


def _generation(text: str) -> int:
    """The generation a part's first line names (-1: none, a part of an older kvgate)."""
    first = text.split("\n", 1)[0]
    digits = first.removeprefix(GENERATION)
    return int(digits) if first.startswith(GENERATION) and digits.isdigit() else -1


def _base(path: Path) -> tuple[str, int]:
    """A slot's base: its dead workers' counters, and the last generation folded in."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return "", -1
    return text, _generation(text)


def fold_dead(directory: Path, slot: int, generation: int) -> None:
    """Worker ``generation`` of ``slot`` is dead: add its last part's counters and histograms
    to the slot's base, which scrapes add to its successor's (the supervisor calls this before
    it starts the successor), and count it in `RESTARTS`. Its part not written yet, or
    already folded: no counts of its own to add."""
    base_path = directory / f"base-{slot}.prom"
    base, folded = _base(base_path)
    if folded >= generation:  # seen already
        return
    whole = directory / f"worker-{slot}.prom"
    try:
        dead = _with_state(whole, directory / f"worker-{slot}.state")
    except (OSError, UnicodeDecodeError):
        dead = ""
    if not folded < _generation(dead) <= generation:  # none of its own: dead before it wrote
        dead = ""
    tmp = base_path.with_name(f"{base_path.name}.tmp")
    try:
        text = add_counters(add_counters(base, dead), restarts(slot, 1))
        tmp.write_text(f"{GENERATION}{generation}\n{text}")
        os.replace(tmp, base_path)  # a scrape sees the old base with its part, or the new alone
    except OSError as exc:
        log.warning("cannot keep a dead worker's counters", extra={"error": str(exc)})


class NoRestarts:
    """A gateway of one process exports the `RESTARTS` family too, without a sample (no worker
    to restart), so that every gateway has the same families whatever its `server.workers`."""

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(RESTARTS.removesuffix("_total"), RESTARTS_HELP,
                                  labels=[WORKER_LABEL])


def restarts(slot: int, n: int) -> str:
    """The `RESTARTS` family, labelled: ``n`` workers of ``slot`` died."""
    return (f"# HELP {RESTARTS} {RESTARTS_HELP}\n"
            f"# TYPE {RESTARTS} counter\n{RESTARTS}{{{WORKER_LABEL}=\"{slot}\"}} {float(n)!r}\n")


def add_counters(live: str, base: str) -> str:
    """``live`` (a labelled part, or "") with the counter and histogram samples of ``base``
    added to its own of the same series; the base's series ``live`` lacks are kept as they are,
    its gauges dropped (a dead worker's in flight is no one's now)."""
    families = _families(live)
    for name, (meta, lines) in _families(base).items():
        if not any(line.split(" ", 3)[3:] in (["counter"], ["histogram"], ["summary"])
                   for line in meta if line.startswith("# TYPE ")):
            continue
        extra = dict(sample for line in lines if (sample := _sample(line)) is not None)
        own_meta, own = families.setdefault(name, (meta, []))
        summed = []
        for line in own:
            sample = _sample(line)
            summed.append(line if sample is None else
                          f"{sample[0]} {sample[1] + extra.pop(sample[0], 0.0)!r}")
        summed.extend(f"{series} {value!r}" for series, value in extra.items())
        families[name] = (own_meta, summed)
    return "".join(f"{line}\n" for meta, lines in families.values() for line in (*meta, *lines))


def _sample(line: str) -> tuple[str, float] | None:
    """A sample line -> (its name and labels, its value); None if it is not one."""
    series, _, value = line.rpartition(" ")
    try:
        return series, float(value)
    except ValueError:
        return None


def label_lines(text: str, slot: int) -> str:
    """Add ``worker="<slot>"`` to every sample line of a Prometheus text exposition."""
    label = f'{WORKER_LABEL}="{slot}"'
    out = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            cut = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=-1)
            if cut < 0:
                continue  # not a sample line
            if line[cut] == "{":
                sep = "" if line[cut + 1:cut + 2] == "}" else ","
                line = f"{line[:cut + 1]}{label}{sep}{line[cut + 1:]}"
            else:
                line = f"{line[:cut]}{{{label}}}{line[cut:]}"
        out.append(line)
    return "\n".join(out) + "\n"


def merge(texts: Mapping[int, str]) -> bytes:
    """Labelled expositions by worker slot -> one exposition: each family's HELP and TYPE
    once (the first worker's), then every worker's samples of it, in first-seen order."""
    metas: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for slot in sorted(texts):
        for name, (meta, lines) in _families(texts[slot]).items():
            if name not in metas:
                metas[name], samples[name] = meta, []
            samples[name].extend(lines)
    out = [line for name, meta in metas.items() for line in (*meta, *samples[name])]
    return ("\n".join(out) + "\n").encode()


def _families(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """family name -> (its HELP/TYPE lines, its sample lines), as the text lists them."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    lines: list[str] | None = None
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            parts = line.split(" ", 3)
            if len(parts) < 3:
                continue
            meta, lines = out.setdefault(parts[2], ([], []))
            meta.append(line)
        elif line and not line.startswith("#") and lines is not None:
            lines.append(line)
    return out
