"""A replica whose `/metrics`, `/health` or `/v1/models` page is huge does not hold the gateway.
vLLM's `/metrics` is tens of KB per engine, `/health` empty, `/v1/models` a card per model; a
page of tens of MB (a proxy's error page looping, an exporter gone wrong, a hostile address in
the pool) used to be read whole into memory, every scrape (four a second) or health probe, and
a `/metrics` page parsed on the event loop: every request through the gateway, `/healthz`
included, waited seconds behind it, and an endless `/health` body grew the gateway by
gigabytes within one probe's timeout. Now a `/metrics` page past the scraper's bound is a
failed scrape, read no further than the bound, and one within it is parsed off the event loop;
`/health` and `/v1/models` are read up to a bound (health is their status; a model list cut
there does not parse and teaches nothing).

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
PAST = 5 * MAX_PAGE_BYTES


def _rss_peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln for ln in f if ln.startswith("VmHWM:")).split()[1])


def _replica_metric(base: str, name: str, replica: str) -> float:
    """`name` of `replica` (host:port) in the gateway's /metrics."""
    values = metric_values(base, name)
    return sum(v for labels, v in values.items() if f'replica="{replica}"' in labels)


@pytest.mark.parametrize(("path", "size", "bound_mib"), [
    # a page within the bound: itself and its lines while they are parsed
    (b"/metrics", PAST, 8 * MAX_PAGE_BYTES >> 20),
    (b"/metrics", MAX_PAGE_BYTES * 3 // 4, 8 * MAX_PAGE_BYTES >> 20),
    (b"/health", PAST, 16),
], ids=["metrics-past-the-bound", "metrics-within-the-bound", "health"])
def test_a_huge_page_does_not_hold_the_gateway(
    sim_factory: Callable[..., tuple[Proc, str]], path: bytes, size: int, bound_mib: int,
) -> None:
    _, sim = sim_factory(model="m")
    with BadReplica("m") as bad:
        # health probes get vLLM's default timeout: the whole page comes within it
        gw, base = gateway_proc(upstreams=[sim, bad.url], env={"KVGATE_HEALTH__TIMEOUT_S": "5"})
        with gw:
            assert gw.popen is not None
            peak_at_start = _rss_peak_kib(gw.popen.pid)
            bad.pages[path] = LINE * (size // len(LINE))
            replica = bad.url.removeprefix("http://")
            if path == b"/metrics" and size > MAX_PAGE_BYTES:
                wait_for(lambda: _replica_metric(
                    base, "kvgate_scrape_errors_total", replica) >= 2, 30, "failed scrapes")
            elif path == b"/metrics":
                wait_for(lambda: _replica_metric(
                    base, "kvgate_replica_running", replica) > 0, 30, "a good scrape")
            waits = []
            with httpx.Client(timeout=30) as http:
                for _ in range(60):  # some 3 s: a dozen scrapes and health probes
                    started = time.monotonic()
                    assert http.get(f"{base}/healthz").status_code == 200
                    waits.append(time.monotonic() - started)
                    time.sleep(0.05)
                # /health is its status: the replica is still in rotation
                assert http.get(f"{base}/readyz").json()["status"] == "ready"
            waits.sort()
            assert waits[len(waits) // 2] < 0.1 and waits[-3] < 0.5, waits
            grown_mib = (_rss_peak_kib(gw.popen.pid) - peak_at_start) / 1024
            assert grown_mib < bound_mib, grown_mib
