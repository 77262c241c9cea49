"""`kvgate serve` with a probe thread, for `bench_soak` (never used in production).

    python -m loadtest.soak_probe OUT_FILE [--tracemalloc] serve ...

Every second the thread rewrites OUT_FILE with one JSON object: the asyncio tasks not done
(counted over every loop of the process), the requests registered as running or waiting,
glibc's C heap in use, every 5 s the live objects per type (after a full collection, counted
on the event loop's thread), with ``SOAK_PROBE_HOLDERS=1`` in the environment what holds the
tasks that are done, and with ``--tracemalloc`` the 15 source lines whose memory grew most
since the 30th second. Counting tasks needs the process itself; RSS and
descriptors `bench_soak` reads from /proc.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import gc
import os
import sys
import threading
import time
import tracemalloc
import types
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

__all__ = ["main"]

T = TypeVar("T")


def _tasks() -> int:
    # asyncio keeps every task of every loop in one weak set; copying it from another thread
    # can race a task being added, so retry (a benchmark's count, not an exact one)
    for _ in range(10):
        try:
            live = list(asyncio.tasks._all_tasks)  # type: ignore[attr-defined]
            return sum(1 for t in live if not t.done())
        except RuntimeError:
            continue
    return -1


def _types() -> dict[str, int]:
    """Live objects per type (gc-tracked ones), the types with more than 20: what grows
    between two of these counts is what leaks."""
    gc.collect()  # garbage not yet collected is no leak: count what is still reachable
    counts: Counter[str] = Counter()
    for obj in gc.get_objects():
        t = type(obj)
        counts[f"{t.__module__}.{t.__qualname__}"] += 1
    return {k: n for k, n in counts.items() if n > 20}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _malloc_mib() -> float | None:
    """C heap in use (glibc's malloc: what native code holds, protobuf's and gRPC's
    included, and Python's larger objects), MiB; None off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return None
    info: _Mallinfo2 = libc.mallinfo2()
    return round(float(info.uordblks + info.hblkhd) / 2**20, 1)


def _describe(ref: object) -> str:
    """A few words on a container holding a task: a dict's keys, a collection's size."""
    if isinstance(ref, dict):
        return "keys " + ",".join(sorted(map(str, ref))[:6])
    if isinstance(ref, (set, list, tuple)) or hasattr(ref, "__len__"):
        return f"{len(ref)} items"
    return ""


def _chain(obj: object, skip: set[int], depth: int = 6) -> list[str]:
    """One path of referrers up from `obj` (the first that is not the probe's own)."""
    path: list[str] = []
    frame = sys._getframe()
    for _ in range(depth):
        refs = [r for r in gc.get_referrers(obj)
                if id(r) not in skip and r is not frame and not isinstance(r, types.FrameType)]
        if not refs:
            break
        skip.add(id(refs))
        obj = refs[0]
        path.append(f"<- {type(obj).__module__}.{type(obj).__qualname__} {_describe(obj)}")
    return [f"{i} {p}" for i, p in enumerate(path)]


def _holders() -> dict[str, int]:
    """What holds the asyncio tasks that are done (a task retained after its end is a leak):
    per referrer, its type, and a frame's function, or a container's own holder's type."""
    gc.collect()
    out: Counter[str] = Counter()
    done = [t for t in gc.get_objects() if isinstance(t, asyncio.Task) and t.done()]
    sample = done[-20:]  # the newest: get_referrers walks every object, per call
    for task in sample:
        for ref in gc.get_referrers(task):
            if ref is done or ref is sample:
                continue
            if isinstance(ref, types.FrameType):
                out[f"frame {ref.f_code.co_qualname} {ref.f_code.co_filename}:{ref.f_lineno}"] += 1
                continue
            out[f"{type(ref).__qualname__}: {_describe(ref)}"] += 1
    out["done tasks"] = len(done)
    if done:
        out.update(dict.fromkeys(_chain(done[-1], {id(done), id(sample)}), 1))
    return dict(out.most_common(12))


def _registered() -> dict[str, int]:
    """Requests registered for shutdown: running, and waiting to be sent (0 when idle)."""
    from gateway import drain

    return {"live": len(drain._LIVE), "waiting": len(drain._WAITING)}


def _top(base: tracemalloc.Snapshot | None) -> list[str]:
    if base is None:
        return []
    stats = tracemalloc.take_snapshot().compare_to(base, "lineno")
    return [str(s) for s in stats[:15]]


def _the_loop() -> asyncio.AbstractEventLoop | None:
    # (no list of the tasks kept while the loop runs `_holders`: it would hold them all)
    for task in list(asyncio.tasks._all_tasks):  # type: ignore[attr-defined]
        return task.get_loop()  # type: ignore[no-any-return]
    return None


def _on_loop(fn: Callable[[], T]) -> T | None:
    """`fn()` run on the gateway's event loop, between two of its callbacks: walking the
    garbage collector's objects from this thread could meet a tuple being built by the main
    thread (and hold a reference that breaks its resize: a SystemError there)."""
    loop = _the_loop()
    if loop is None:
        return None
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except Exception as exc:
            done.set_exception(exc)

    loop.call_soon_threadsafe(run)
    try:
        return done.result(timeout=30)
    except (concurrent.futures.TimeoutError, RuntimeError):
        return None


def _loop(out: str, traced: bool) -> None:
    base: tracemalloc.Snapshot | None = None  # taken once warm: imports and caches are no leak
    counted: dict[str, int] | None = {}
    holders: dict[str, int] | None = None
    top: list[str] = []
    n = 0
    while True:
        time.sleep(1.0)
        n += 1
        doc: dict[str, Any] = {"tasks": _tasks(), "threads": threading.active_count(),
                               "malloc_mib": _malloc_mib(), **_registered()}
        if n % 5 == 0:
            counted = _on_loop(_types)
            if os.environ.get("SOAK_PROBE_HOLDERS"):
                holders = _on_loop(_holders)
        doc["types"] = counted or {}
        if holders:
            doc["holders"] = holders
        doc["gc_objects"] = sum(doc["types"].values())
        if traced and n == 30:
            base = tracemalloc.take_snapshot()
        elif traced and n % 15 == 0:
            top = _top(base)
        doc["top"] = top
        tmp = out + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(orjson.dumps(doc))
            os.replace(tmp, out)
        except OSError:  # the benchmark is over (its directory removed)
            return


def main(argv: list[str]) -> int:
    out, rest = argv[0], argv[1:]
    traced = bool(rest) and rest[0] == "--tracemalloc"
    if traced:
        rest = rest[1:]
        tracemalloc.start(4)
    threading.Thread(target=_loop, args=(out, traced), daemon=True).start()
    from gateway.cli import main as kvgate

    return kvgate(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
