"""`server.workers 2`: whichever worker a scrape reaches, /metrics has both workers' series
(labelled `worker`), their sum counts every request once, and counters never go back."""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.slow

MODEL = "sim-model"


def _requests_by_worker(base: str) -> dict[str, float]:
    """kvgate_requests_total summed per worker, from one scrape on a new connection."""
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
        text = c.get(f"{base}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for labels, value in re.findall(r"^kvgate_requests_total\{([^}]*)\} (\S+)$", text, re.M):
        worker = re.search(r'worker="(\d+)"', labels)
        assert worker is not None, labels  # every series carries its worker
        out[worker.group(1)] = out.get(worker.group(1), 0.0) + float(value)
    return out


def test_metrics_of_two_workers_count_every_request_once(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    upstream = sim_factory()[1]
    proc, base = gateway_proc(config={
        "pools": {"p": {"replicas": [upstream], "served_model": MODEL}},
        "models": {MODEL: {"default": "p"}},
        "server": {"workers": 2},
    }, env={"KVGATE_REDIS_URL": redis_url})
    with proc:
        sent = [0]
        stop = threading.Event()

        def load() -> None:  # a new connection each: the kernel spreads them over workers
            with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as fresh:
                # the SDK annotates http_client as httpx2.Client but takes an httpx.Client
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                       timeout=30, http_client=fresh)  # type: ignore[arg-type]
                while not stop.is_set():
                    client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"hi {sent[0]}"}],
                        max_tokens=2)
                    sent[0] += 1

        loader = threading.Thread(target=load)
        loader.start()
        try:
            wait_for(lambda: sent[0] >= 10, timeout=30, what="traffic")
            seen = [_requests_by_worker(base) for _ in range(15)]  # while requests flow
        finally:
            stop.set()
            loader.join(30)
        for before, after in itertools.pairwise(seen):  # scrapes reach either worker
            for worker, n in before.items():
                assert after.get(worker, 0.0) >= n, (before, after)

        def all_counted() -> bool:
            last = _requests_by_worker(base)
            return sum(last.values()) == sent[0] and len(last) == 2 and min(last.values()) > 0

        wait_for(all_counted, timeout=15, what="both workers' requests in one scrape")
