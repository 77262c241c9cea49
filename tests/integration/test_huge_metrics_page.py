"""A replica whose `/metrics` page is huge does not hold the gateway. vLLM's page is tens of
KB per engine; a page of tens of MB (a proxy's error page looping, a metrics exporter gone wrong,
a hostile address in the pool) used to be read whole into memory and parsed on the event loop,
four times a second: every request through the gateway, `/healthz` included, waited seconds
behind it. A page past the scraper's bound is now a failed scrape, read no further than the
bound; a page within it is parsed off the event loop.

A real gateway in front of a real simulated replica and a loopback replica serving the page.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import pytest

from gateway.scrape import MAX_PAGE_BYTES
from tests.support.bad_replica import BadReplica
from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

# each line a series the scraper reads, the costliest kind of line to parse
LINE = b'vllm:num_requests_running{engine="0",model_name="m"} 1\n'


def _rss_peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1])


def _scrapes(base: str, replica: str) -> tuple[float, float]:
    """(failed scrapes, scraped running requests) of `replica` (host:port) in /metrics."""
    def one(name: str) -> float:
        values = metric_values(base, name)
        return sum(v for labels, v in values.items() if f'replica="{replica}"' in labels)
    return one("kvgate_scrape_errors_total"), one("kvgate_replica_running")


@pytest.mark.parametrize("size", [5 * MAX_PAGE_BYTES, MAX_PAGE_BYTES * 3 // 4],
                         ids=["past-the-bound", "within-the-bound"])
def test_a_huge_metrics_page_does_not_hold_the_gateway(
    sim_factory: Callable[..., tuple[Proc, str]], size: int,
) -> None:
    _, sim = sim_factory(model="m")
    with BadReplica("m") as bad:
        bad.metrics = LINE * (size // len(LINE))
        gw, base = gateway_proc(upstreams=[sim, bad.url])
        with gw:
            assert gw.popen is not None
            peak_at_start = _rss_peak_kib(gw.popen.pid)
            replica = bad.url.removeprefix("http://")
            if size > MAX_PAGE_BYTES:
                wait_for(lambda: _scrapes(base, replica)[0] >= 2, 30, "failed scrapes")
            else:
                wait_for(lambda: _scrapes(base, replica)[1] > 0, 30, "a good scrape")
            waits = []
            with httpx.Client(timeout=30) as http:
                for _ in range(60):  # some 3 s: a dozen scrapes of the page
                    started = time.monotonic()
                    assert http.get(f"{base}/healthz").status_code == 200
                    waits.append(time.monotonic() - started)
                    time.sleep(0.05)
            waits.sort()
            assert waits[len(waits) // 2] < 0.1 and waits[-3] < 0.5, waits
            # the page (bounded) and its lines while they are parsed, not 5 times the bound
            grown_mib = (_rss_peak_kib(gw.popen.pid) - peak_at_start) / 1024
            assert grown_mib < 8 * MAX_PAGE_BYTES / 2**20, grown_mib
