"""Two OS processes admitting against one Redis concurrently share one budget exactly.

This module is also the worker: ``python -m tests.integration.test_tenancy_limits_procs
URL NAMESPACE MODE N LIMIT`` waits for a start signal in Redis, fires N admissions at once and
prints how many were allowed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis

from gateway.policy_doc import Limits
from gateway.tenancy import RedisRateLimiter, connect_redis
from tests.support.procs import ROOT, redis_proc

FIXED_NOW = 1_700_000_000.0  # a frozen clock: no refill during the run, so counts are exact


async def _worker(url: str, ns: str, mode: str, n: int, limit: int) -> int:
    client = connect_redis(url, timeout_s=5.0)
    clock = (lambda: FIXED_NOW) if mode == "rpm" else None
    limiter = RedisRateLimiter(client, namespace=ns, clock=clock)
    limits = Limits(rpm=limit) if mode == "rpm" else Limits(max_concurrency=limit)
    await client.incr(f"{ns}:ready")
    await client.blpop([f"{ns}:go"], timeout=30)
    results = await asyncio.gather(*(limiter.admit("acme", limits, tokens=1) for _ in range(n)))
    await client.aclose()
    return sum(a.allowed for a in results)  # leases are deliberately held (never released)


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[str]:
    proc, url = redis_proc()
    with proc:
        yield url


@pytest.mark.parametrize("mode", ["rpm", "conc"])
def test_two_processes_share_one_budget(shared_redis: str, mode: str) -> None:
    ns, limit, per_process = f"t{secrets.token_hex(4)}", 25, 40
    cmd = [sys.executable, "-m", __name__, shared_redis, ns, mode, str(per_process), str(limit)]
    workers = [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    sync = redis.Redis.from_url(shared_redis)
    try:
        deadline = time.monotonic() + 30
        while int(sync.get(f"{ns}:ready") or 0) < 2:  # both workers connected and waiting
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.02)
        sync.rpush(f"{ns}:go", 1, 1)
        outputs = [w.communicate(timeout=60) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        sync.close()
    counts = [json.loads(out)["allowed"] for out, _ in outputs]
    assert all(w.returncode == 0 for w in workers), [err for _, err in outputs]
    assert sum(counts) == limit, counts  # not 2 x limit: the budget is shared exactly


if __name__ == "__main__":
    url_, ns_, mode_, n_, limit_ = sys.argv[1:6]
    allowed = asyncio.run(_worker(url_, ns_, mode_, int(n_), int(limit_)))
    print(json.dumps({"allowed": allowed}))
