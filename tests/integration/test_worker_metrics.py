"""`server.workers 2`: whichever worker a scrape reaches, /metrics has both workers' series
(labelled `worker`), their sum counts every request once, and counters never go back."""

from __future__ import annotations

import itertools
import re
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
        fresh = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
        # the SDK annotates http_client as httpx2.Client but also takes an httpx.Client
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                               timeout=30, http_client=fresh)  # type: ignore[arg-type]
        sent = 40
        for i in range(sent):  # a new connection each: the kernel spreads them
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=2)
        fresh.close()
        seen: list[dict[str, float]] = []

        def all_counted() -> bool:
            seen.append(_requests_by_worker(base))
            return sum(seen[-1].values()) == sent and len(seen[-1]) == 2

        wait_for(all_counted, timeout=15, what="both workers' requests in one scrape")
        assert all(n > 0 for n in seen[-1].values()), seen[-1]  # both served some
        for _ in range(10):  # scrapes land on either worker: nothing goes back
            seen.append(_requests_by_worker(base))
        tail = seen[-11:]
        for before, after in itertools.pairwise(tail):
            for worker, n in before.items():
                assert after.get(worker, 0.0) >= n, (before, after)
