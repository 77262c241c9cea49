"""``kvgate_overhead_seconds{phase="pre_upstream"}`` is kvgate's own time before the upstream
request, not the time a request waited in flow control's queue (that is
``kvgate_flow_wait_seconds``).

A queued request's whole wait was counted as overhead: 3 of 4 observations above the top
bucket (12.8 ms) with 3 requests queued, so the dashboard's overhead p99 read the top bucket
whenever the fleet was saturated. One real gateway, ``flow.max_inflight: 1`` and one
simulated replica whose streams hang after a few tokens: a filler stream holds the only slot
while a second request waits; the official openai client sends both."""

from __future__ import annotations

import threading
import time

import openai

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import sim_proc


def _sum(base: str, name: str, labels: str = "") -> float:
    return sum(v for k, v in metric_values(base, name).items() if labels in k)


def test_a_queued_requests_wait_is_not_kvgate_overhead() -> None:
    sim, sim_url = sim_proc(None, "--hang-after-tokens", "5", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim_url]}},
              "models": {"llama": {"default": "p"}},
              "flow": {"enabled": True, "max_inflight": 1}}
    with sim:
        gw, base = gateway_proc(config=config)
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                   timeout=60)
            filler = client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "hold the slot"}],
                max_tokens=50, stream=True)
            next(iter(filler))  # it is in flight: the pool is saturated
            done = threading.Event()

            def queued() -> None:
                client.completions.create(model="llama", prompt="wait", max_tokens=3)
                done.set()

            worker = threading.Thread(target=queued)
            worker.start()
            wait_for(lambda: _sum(base, "kvgate_flow_queue_depth") == 1, what="one queued")
            time.sleep(2.0)  # it waits two seconds in the queue
            filler.close()  # the slot frees: the queued request is sent
            worker.join(timeout=60)
            assert done.is_set()
            waited = _sum(base, "kvgate_flow_wait_seconds_sum")
            overhead = _sum(base, "kvgate_overhead_seconds_sum", 'phase="pre_upstream"')
            assert waited >= 2.0
            # two requests' own time before upstream: far below the second's wait alone
            assert overhead < waited, (overhead, waited)
