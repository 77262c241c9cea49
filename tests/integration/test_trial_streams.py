"""Back from an outage, every replica of a pool is on trial, one request at a time, judged at
its end: while long trial streams flow, a new request is served by a replica whose trial
answers rather than refused with 503 until the longest of them ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
from openai.types.chat import ChatCompletionChunk

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"


def healthy(base: str, url: str) -> float:
    return metric_values(base, "kvgate_replica_healthy")[f'{{pool="default",replica="{url[7:]}"}}']


def first_chunk(stream: Iterator[ChatCompletionChunk]) -> None:
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return
    raise AssertionError("the stream ended before its first token")


def test_a_pool_on_trial_serves_beside_its_answering_trials(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    urls = [sim_factory("--time-scale", "1")[1] for _ in range(2)]
    gw, base = gateway_proc(upstreams=urls)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    with gw:
        for url in urls:  # an outage: both engines dead, found by the health checks
            httpx.post(f"{url}/sim/faults", json={"dead": True}).raise_for_status()
        wait_for(lambda: all(healthy(base, u) == 0.0 for u in urls), timeout=30,
                 what="both replicas out")
        for url in urls:
            httpx.post(f"{url}/sim/faults", json={"dead": False}).raise_for_status()
        wait_for(lambda: all(healthy(base, u) == 1.0 for u in urls), timeout=30,
                 what="both replicas on trial")
        trials = []
        for i in range(2):  # one long trial stream each, answering (first tokens read)
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"long story {i}"}],
                max_tokens=4000, stream=True)
            first_chunk(iter(stream))
            trials.append(stream)
        try:
            assert {s.response.headers["x-kvgate-replica"] for s in trials} == {
                f"default/{u[7:]}" for u in urls}
            # before: 503 "No healthy replica ... (2 replicas: 2 on trial after an ejection)"
            answer = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "short"}], max_tokens=2)
            assert answer.choices[0].message.content
        finally:
            for stream in trials:
                stream.close()
