"""Each worker's /metrics part: merged with the worker label, stale parts left out."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gateway.worker_metrics import (
    STALE_AFTER_S,
    WorkerExposition,
    WorkerSlot,
    label_lines,
    merge,
)

EXPOSITION = """# HELP kvgate_requests_total finished proxied requests
# TYPE kvgate_requests_total counter
kvgate_requests_total{pool="p"} %d.0
# HELP kvgate_ttft_seconds time to first token
# TYPE kvgate_ttft_seconds histogram
kvgate_ttft_seconds_bucket{le="0.1",pool="p"} 1.0
kvgate_ttft_seconds_bucket{le="+Inf",pool="p"} 2.0
kvgate_ttft_seconds_sum{pool="p"} 0.5
kvgate_ttft_seconds_count{pool="p"} 2.0
"""


def _no_state() -> bytes:
    return b""


def _exposition(slot: int, directory: Path, own: Callable[[], bytes]) -> WorkerExposition:
    """A worker's exposition without series of its own read at scrape time."""
    return WorkerExposition(WorkerSlot(slot, directory), own, _no_state)


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_merge_labels_every_sample_with_its_worker_and_keeps_one_family() -> None:
    out = merge({1: label_lines(EXPOSITION % 4, 1), 0: label_lines(EXPOSITION % 3, 0)})
    assert out.count(b"# TYPE kvgate_requests_total counter") == 1
    assert out.count(b"# TYPE kvgate_ttft_seconds histogram") == 1
    samples = _samples(out)
    assert samples[("kvgate_requests_total", (("pool", "p"), ("worker", "0")))] == 3
    assert samples[("kvgate_requests_total", (("pool", "p"), ("worker", "1")))] == 4
    assert samples[("kvgate_ttft_seconds_bucket",
                    (("le", "+Inf"), ("pool", "p"), ("worker", "1")))] == 2
    assert len(samples) == 2 * 5


def test_a_scrape_serves_this_workers_series_as_of_now_and_no_later_scrape_goes_back(
    tmp_path: Path,
) -> None:
    count = [3]
    mine = _exposition(0, tmp_path, lambda: (EXPOSITION % count[0]).encode())
    other = _exposition(1, tmp_path, lambda: (EXPOSITION % 5).encode())
    other.publish()
    mine.publish()
    count[0] = 7  # served since its last write: a scrape reaching it sees it at once
    samples = _samples(mine.render())
    assert samples[("kvgate_requests_total", (("pool", "p"), ("worker", "0")))] == 7
    assert samples[("kvgate_requests_total", (("pool", "p"), ("worker", "1")))] == 5
    # the next scrape reaches the other worker: it reads what this one served, not less
    assert _samples(other.render())[
        ("kvgate_requests_total", (("pool", "p"), ("worker", "0")))] == 7
    other.remove()  # a worker that stops takes its part away
    assert ("kvgate_requests_total", (("pool", "p"), ("worker", "1"))) not in _samples(
        mine.render())


def test_label_lines_handles_every_sample_shape() -> None:
    text = ('# HELP a_total x\n# TYPE a_total counter\na_total 1.0\n'
            'b{} 2.0\nc{x="a b} c"} 3.0\nd{x="1"} 4.0 1700000000000\n')
    samples = _samples(label_lines(text, 3).encode())
    assert samples[("a_total", (("worker", "3"),))] == 1.0
    assert samples[("b", (("worker", "3"),))] == 2.0
    assert samples[("c", (("worker", "3"), ("x", "a b} c")))] == 3.0
    assert samples[("d", (("worker", "3"), ("x", "1")))] == 4.0


def test_a_broken_part_loses_nothing_else(tmp_path: Path) -> None:
    mine = _exposition(0, tmp_path, lambda: (EXPOSITION % 1).encode())
    (tmp_path / "worker-1.prom").write_bytes(b"\xff\xfe not text {{{\n# TYPE\n")
    assert {dict(k[1]).get("worker") for k in _samples(mine.render())} == {"0"}


def test_a_failed_write_serves_what_the_others_can_read(tmp_path: Path) -> None:
    """Serving newer values than the file holds would let the next scrape, reaching another
    worker, go back."""
    count = [3]
    mine = _exposition(0, tmp_path, lambda: (EXPOSITION % count[0]).encode())
    mine.publish()
    path = tmp_path / "worker-0.prom"
    path.unlink()
    path.mkdir()  # the next write fails (a directory cannot be replaced by a file)
    count[0] = 9
    key = ("kvgate_requests_total", (("pool", "p"), ("worker", "0")))
    assert _samples(mine.render())[key] == 3


def test_a_part_not_rewritten_for_a_while_is_left_out(tmp_path: Path) -> None:
    mine = _exposition(0, tmp_path, lambda: (EXPOSITION % 1).encode())
    hung = _exposition(1, tmp_path, lambda: (EXPOSITION % 2).encode())
    hung.publish()
    path = tmp_path / "worker-1.prom"
    old = path.stat().st_mtime - STALE_AFTER_S - 1
    os.utime(path, (old, old))
    labels = {dict(k[1]).get("worker") for k in _samples(mine.render())}
    assert labels == {"0"}
    (tmp_path / "worker-x.prom").write_text("not a worker's file")  # ignored, not an error
    (tmp_path / "worker-2.tmp").write_text("half written")
    assert {dict(k[1]).get("worker") for k in _samples(mine.render())} == {"0"}


def test_the_writer_keeps_serving_when_its_directory_is_gone(tmp_path: Path) -> None:
    gone = tmp_path / "removed"
    ex = _exposition(0, gone, lambda: (EXPOSITION % 1).encode())

    async def a_few_rounds() -> None:
        task = asyncio.create_task(ex.run())
        await asyncio.sleep(0.05)
        assert not task.done()  # logged, not raised
        task.cancel()

    asyncio.run(a_few_rounds())
    assert _samples(ex.render())  # its own series still answer


def test_each_part_is_rewritten_every_second(tmp_path: Path) -> None:
    """docs/metrics.md: a scrape reaching another worker shows this one's series at most a
    second old (in-flight gauges showed streams that had ended 4 s before at 5 s)."""
    writes = []

    def own() -> bytes:
        writes.append(1)
        return (EXPOSITION % len(writes)).encode()

    ex = _exposition(0, tmp_path, own)

    async def two_seconds() -> None:
        task = asyncio.create_task(ex.run())
        await asyncio.sleep(2.2)
        task.cancel()

    asyncio.run(two_seconds())
    assert len(writes) >= 2, writes  # at once, then after a second (at least)


def test_a_slow_write_is_made_less_often(tmp_path: Path) -> None:
    """A write renders the registry on the event loop: one that takes 100 ms (thousands of
    series) made every second blocked every request of the worker 10 % of the time."""
    writes = []

    def own() -> bytes:
        writes.append(1)
        time.sleep(0.1)  # (a large registry's render: on the loop, as the real one)
        return (EXPOSITION % len(writes)).encode()

    ex = _exposition(0, tmp_path, own)

    async def two_seconds() -> None:
        task = asyncio.create_task(ex.run())
        await asyncio.sleep(2.5)
        task.cancel()

    asyncio.run(two_seconds())
    assert len(writes) == 1, writes  # the next one after 5 s: 2 % of the loop's time


STATE = """# HELP kvgate_flow_queue_depth requests waiting in flow control's queue
# TYPE kvgate_flow_queue_depth gauge
kvgate_flow_queue_depth{band="0",pool="p"} %d.0
"""


def test_a_slow_workers_state_reaches_the_others_within_a_second_or_so(tmp_path: Path) -> None:
    """A worker whose whole part takes 150 ms to render rewrites it every 7.5 s (2 % of its
    loop), but its queue depth, in flight and health are written apart every second: a
    queue building in one worker was seen seconds late by a scrape reaching the other."""
    depth = [0]

    def own() -> bytes:
        time.sleep(0.15)  # (a large registry's render: on the loop, as the real one)
        return (EXPOSITION % 1 + STATE % depth[0]).encode()

    busy = WorkerExposition(WorkerSlot(0, tmp_path), own, lambda: (STATE % depth[0]).encode())
    other = _exposition(1, tmp_path, lambda: (EXPOSITION % 2).encode())
    key = ("kvgate_flow_queue_depth", (("band", "0"), ("pool", "p"), ("worker", "0")))

    async def scrape_the_other() -> list[float]:
        task = asyncio.create_task(busy.run())
        for _ in range(100):  # its first write
            if (tmp_path / "worker-0.prom").exists():
                break
            await asyncio.sleep(0.05)
        depth[0] = 5  # queued in the busy worker, just after its whole part was written
        seen = []
        for _ in range(40):  # 4 s, well before its whole part is due again
            await asyncio.sleep(0.1)
            seen.append(_samples(other.render())[key])
            if seen[-1] == 5:
                break
        task.cancel()
        return seen

    seen = asyncio.run(scrape_the_other())
    assert seen[-1] == 5, seen
    samples = _samples(other.render())  # the whole part's series are still there, once
    assert samples[("kvgate_requests_total", (("pool", "p"), ("worker", "0")))] == 1
    assert samples[("kvgate_requests_total", (("pool", "p"), ("worker", "1")))] == 2
    assert other.render().count(b"# TYPE kvgate_flow_queue_depth gauge") == 1
