"""`server.workers`: a worker whose whole /metrics part takes long to render (tens of
thousands of series: many tenants listed in `tenancy.metrics_tenants`, many replicas) rewrites
it less often, at most 2 % of its loop (every 50 renders' time), while it writes its state part
every second. Its whole part's age was also what told the other workers it was alive: past
`STALE_AFTER_S` (a render of 0.3 s or more), a scrape reaching another worker left the busy
worker's series out until its next render, and the gateway's totals went back and forth."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from gateway.worker_metrics import STALE_AFTER_S, WorkerExposition, WorkerSlot

PART = """# HELP kvgate_requests_total finished requests
# TYPE kvgate_requests_total counter
kvgate_requests_total{pool="p"} %d.0
"""
RENDER_S = 0.15  # its whole part: rewritten every 7.5 s (2 % of its loop)
AHEAD_S = STALE_AFTER_S - 3  # the other worker looks this much later: 3 s of leeway


def _workers(directory: Path) -> set[str]:
    """The workers whose series a scrape reaching worker 1 shows, AHEAD_S later."""
    other = WorkerExposition(WorkerSlot(1, directory), lambda: (PART % 1).encode(),
                             lambda: b"", clock=lambda: time.time() + AHEAD_S)
    return {s.labels["worker"] for f in text_string_to_metric_families(other.render().decode())
            for s in f.samples if s.name == "kvgate_requests_total"}


def test_a_busy_worker_stays_in_the_others_scrapes_between_its_renders(tmp_path: Path) -> None:
    def own() -> bytes:
        time.sleep(RENDER_S)  # (a large registry's render: on the loop, as the real one)
        return (PART % 5).encode()

    busy = WorkerExposition(WorkerSlot(0, tmp_path), own, lambda: b"")

    async def scrape_later() -> set[str]:
        task = asyncio.create_task(busy.run())
        for _ in range(200):  # its first write
            if (tmp_path / "worker-0.prom").exists():
                break
            await asyncio.sleep(0.05)
        # past 3 s, the whole part written at the start looks older than STALE_AFTER_S to
        # the other worker; its next render is due at 7.5 s
        await asyncio.sleep(5)
        seen = _workers(tmp_path)
        task.cancel()
        return seen

    assert asyncio.run(scrape_later()) == {"0", "1"}
