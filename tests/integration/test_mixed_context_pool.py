"""A pool whose replicas differ in context length (a rolling change of vLLM's
``--max-model-len``, or mixed hardware behind one pool): a prompt longer than one replica's
context (or with the output it asks for, past it) but within another's goes to the one that
can take it. It went to either: 4 requests of 10 were answered vLLM's 400 "maximum context
length is 2048 tokens" while kvgate's own /v1/models said the model takes 16384 and the other
replica would have served them.

A real gateway in front of two real simulated replicas.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import httpx
import openai

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]


def test_a_prompt_past_one_replicas_context_goes_to_a_longer_one(
    sim_factory: SimFactory,
) -> None:
    _, short = sim_factory("--time-scale", "50", "--max-model-len", "2048", model="m")
    _, long = sim_factory("--time-scale", "50", "--max-model-len", "16384", model="m")
    config = {"pools": {"p": {"served_model": "m", "replicas": [short, long]}},
              "routing": {"policy": "cache_aware"}}
    gw, base = gateway_proc(config=config)
    with gw:
        wait_for(lambda: httpx.get(f"{base}/v1/models").json()["data"][0].get(
            "max_model_len") == 16384, what="the replicas' context lengths learned")
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        answered: Counter[tuple[int, str]] = Counter()
        for i in range(10):
            words = f"question {i} " + "word " * 4000  # ~5,000 tokens
            raw = c.chat.completions.with_raw_response.create(
                model="m", max_tokens=2, messages=[{"role": "user", "content": words}])
            answered[(raw.status_code, raw.headers["x-kvgate-replica"])] += 1
        # a prompt that fits, with the output it asks for past the short replica's context
        for i in range(6):
            words = f"task {i} " + "word " * 1200  # ~1,500 tokens, and 1,000 asked for
            raw = c.chat.completions.with_raw_response.create(
                model="m", max_tokens=1000, messages=[{"role": "user", "content": words}])
            answered[(raw.status_code, raw.headers["x-kvgate-replica"])] += 1
        assert answered == {(200, f"p/{long.removeprefix('http://')}"): 16}
        # a short prompt may go to either (no replica is left out for good)
        for i in range(6):
            raw = c.chat.completions.with_raw_response.create(
                model="m", max_tokens=2, messages=[{"role": "user", "content": f"hi {i}"}])
            answered[(raw.status_code, raw.headers["x-kvgate-replica"])] += 1
        assert (200, f"p/{short.removeprefix('http://')}") in answered
