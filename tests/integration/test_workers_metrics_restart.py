"""`server.workers 2`: a worker killed (SIGKILL, as the OOM killer does) and started again
takes over its slot's series without taking the gateway's counters back, and
`kvgate_worker_restarts_total` counts it. Its predecessor's
counts stay in /metrics: a dashboard summing `kvgate_requests_total` over `worker` went from
89 to 70 when one of three workers was killed and replaced (each of the dead worker's series
restarted from 0)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.worker_metrics import WorkerExposition, WorkerSlot, fold_dead
from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
RESTARTS = "kvgate_worker_restarts_total"
PART = """# HELP kvgate_requests_total finished requests
# TYPE kvgate_requests_total counter
kvgate_requests_total{pool="p"} %d.0
# HELP kvgate_inflight_requests in flight
# TYPE kvgate_inflight_requests gauge
kvgate_inflight_requests{pool="p"} %d.0
# HELP kvgate_ttft_seconds time to first token
# TYPE kvgate_ttft_seconds histogram
kvgate_ttft_seconds_bucket{le="+Inf",pool="p"} %d.0
kvgate_ttft_seconds_count{pool="p"} %d.0
kvgate_ttft_seconds_sum{pool="p"} 0.5
"""
Samples = dict[tuple[str, str], float]


def _worker(slot: WorkerSlot, requests: int, inflight: int) -> WorkerExposition:
    part = (PART % (requests, inflight, requests, requests)).encode()
    return WorkerExposition(slot, lambda: part, lambda: b"")


def _samples(text: bytes) -> Samples:
    return {(s.name, s.labels["worker"]): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_a_dead_workers_counts_are_counted_once_and_its_gauges_dropped(tmp_path: Path) -> None:
    """The part the supervisor folded is still on disk until the successor's first write: a
    scrape in between counts it once (the base names the generation it holds)."""
    other = _worker(WorkerSlot(0, tmp_path), 1, 0)
    _worker(WorkerSlot(1, tmp_path, generation=0), 7, 3).publish()  # its last write
    fold_dead(tmp_path, 1, 0)  # killed: its part stays where it was
    fold_dead(tmp_path, 1, 0)  # seen twice (or its successor died before it wrote): once
    seen = _samples(other.render())
    assert seen[("kvgate_requests_total", "1")] == 7
    assert seen[("kvgate_ttft_seconds_count", "1")] == 7
    assert ("kvgate_inflight_requests", "1") not in seen  # its requests died with it
    assert (seen[(RESTARTS, "0")], seen[(RESTARTS, "1")]) == (0, 1)
    successor = _worker(WorkerSlot(1, tmp_path, generation=1), 2, 1)
    for scraped in (successor.render(), other.render()):
        now = _samples(scraped)
        assert now[("kvgate_requests_total", "1")] == 9
        assert now[("kvgate_ttft_seconds_bucket", "1")] == 9
        assert now[("kvgate_inflight_requests", "1")] == 1
        assert now[("kvgate_requests_total", "0")] == 1


def _series(base: str, name: str = "kvgate_requests_total") -> dict[str, float]:
    """{labels: value} of one family, from one scrape on a new connection."""
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
        text = c.get(f"{base}/metrics", timeout=10).text
    return {labels: float(value) for labels, value in
            re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.M)}


def _children(proc: Proc) -> set[int]:
    assert proc.popen is not None
    out = subprocess.run(["pgrep", "-P", str(proc.popen.pid)], capture_output=True, text=True)
    return {int(pid) for pid in out.stdout.split()}


def _send(base: str, n: int) -> None:
    for i in range(n):  # a new connection each: the kernel spreads them over the workers
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30) as c:
            r = c.post(f"{base}/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": f"hi {i}"}],
                "max_tokens": 2})
            assert r.status_code == 200, r.text


@pytest.mark.slow
def test_a_replaced_workers_counts_stay_in_the_gateways_totals(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    upstream = sim_factory()[1]
    gw, base = gateway_proc(config={
        "pools": {"p": {"replicas": [upstream], "served_model": MODEL}},
        "models": {MODEL: {"default": "p"}}, "server": {"workers": 2},
    }, env={"KVGATE_REDIS_URL": redis_url})
    with gw:
        sent = 0
        while len({re.search(r'worker="(\d)"', k).group(1)  # type: ignore[union-attr]
                   for k in _series(base)}) < 2 and sent < 60:  # both workers counted some
            _send(base, 4)
            sent += 4
        wait_for(lambda: sum(_series(base).values()) == sent, timeout=20,
                 what="every request in one scrape")
        before = _series(base)
        assert _series(base, RESTARTS) == {'worker="0"': 0.0, 'worker="1"': 0.0}
        workers = _children(gw)
        victim = min(workers)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: len(_children(gw) - workers) == 1, timeout=30,
                 what="the killed worker started again")
        _send(base, 10)
        sent += 10

        def all_counted() -> bool:
            now = _series(base)
            for labels, value in before.items():  # no series goes back, whichever answers
                assert now.get(labels, 0.0) >= value, (labels, value, now)
            return sum(now.values()) == sent

        wait_for(all_counted, timeout=30, what="the gateway's totals to count every request")
        assert sorted(_series(base, RESTARTS).values()) == [0.0, 1.0]  # the killed one's slot
        assert gw.popen is not None and gw.popen.poll() is None, gw.output()
