"""A replica that serves requests well but answers `/health` late stays in rotation (gray
failures, scenario 6: `loadtest.gray_failures`). It used to be ejected after
`health.slow_threshold` slow probes in a row, and then kept out for as long as its `/health`
stayed slow: a healthy replica lost, the others taking its share."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import httpx
import openai

from tests.support.gateway import gateway_proc, metric_values
from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]


def test_a_slow_health_check_does_not_eject_a_replica_that_answers(
    sim_factory: SimFactory,
) -> None:
    (_, slow), (_, other) = sim_factory("--time-scale", "50"), sim_factory("--time-scale", "50")
    httpx.post(f"{slow}/sim/faults", json={"health_latency_ms": 800}).raise_for_status()
    gw, base = gateway_proc(upstreams=[slow, other], args=["--policy", "round_robin"],
                            env={"KVGATE_HEALTH__TIMEOUT_S": "0.3",
                                 "KVGATE_HEALTH__SLOW_THRESHOLD": "3"})
    rid = slow.removeprefix("http://")
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        late: Counter[str] = Counter()
        start = time.monotonic()
        while (t := time.monotonic() - start) < 5.0:  # ten slow probes and more
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt="hello there", max_tokens=4)
            if t > 3.5:
                late[raw.headers["x-kvgate-replica"].split("/", 1)[1]] += 1
        key = f'{{pool="default",replica="{rid}"}}'
        assert metric_values(base, "kvgate_replica_healthy")[key] == 1.0
        assert late[rid] >= late.total() // 3, late  # still takes its round-robin turn
