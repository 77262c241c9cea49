"""vLLM serves /metrics on the event loop that serves its requests: a saturated replica answers
its scrape late, exactly when its load matters most. The scrape timeout was max(0.5 s, 4 x
routing.scrape_interval_ms), 1 s by default: a page 1.5 s late was never read, and nothing the
page said (its load, its engine asleep) reached the router. A page later than the interval but
within `routing.scrape_timeout_ms` is read now; another replica's scrapes go on meanwhile.
Real gateway, simulated replicas (their /metrics latency fault)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]


def _faults(sim: str, **faults: object) -> None:
    httpx.post(f"{sim}/sim/faults", json=faults, timeout=10).raise_for_status()


def _replica_says(base: str, what: str) -> bool:
    return what in httpx.get(f"{base}/readyz", timeout=5).text


def test_a_page_later_than_the_interval_is_still_read(sim_factory: SimFactory) -> None:
    _, slow = sim_factory("--time-scale", "50")
    _, fast = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[slow, fast])
    with gw:
        # what only a scrape tells: the engines asleep (vllm:engine_sleep_state)
        _faults(slow, metrics_latency_ms=1500, sleeping=1)
        _faults(fast, sleeping=1)
        wait_for(lambda: _replica_says(base, f"{slow.removeprefix('http://')}: its engine is "
                                             "asleep"), timeout=30,
                 what="the slow replica's page read")
        assert _replica_says(base, f"{fast.removeprefix('http://')}: its engine is asleep")
        errors = metric_values(base, "kvgate_scrape_errors")
        assert all(v == 0 for v in errors.values()), errors  # late, never failed
