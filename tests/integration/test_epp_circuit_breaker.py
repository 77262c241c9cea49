"""Envoy's circuit breaker on the replicas' cluster (its defaults: 1,024 requests, 1,024
pending; a Gateway implementation's Envoy may set less): past it Envoy sends nothing and
answers its own 503 "... reset reason: overflow". That is not the replica's failure: it was
charged as a broken connection, so a busy pool's healthy replicas were all ejected within a
few overflows (502s, then the pool's 503 for everyone). It is a 503 with Retry-After, the
replicas untouched.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import inflight, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"


def _one_request_at_a_time(config: dict[str, Any]) -> None:
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "kvgate_pool":
            cluster["circuit_breakers"] = {"thresholds": [
                {"max_connections": 1, "max_pending_requests": 1, "max_requests": 1}]}


def _ask(client: openai.OpenAI) -> str:
    try:
        stream = client.completions.create(model=MODEL, prompt="x", max_tokens=300,
                                           stream=True, extra_body={"ignore_eos": True})
        return f"{sum(1 for _ in stream) > 0}"
    except openai.APIStatusError as exc:
        retry = exc.response.headers.get("retry-after")
        body: Any = exc.body  # the error object
        return f"{exc.status_code} {retry} {body['message']}"


def test_envoys_overflow_is_a_503_and_no_replicas_failure() -> None:
    procs: list[Proc] = []
    try:
        urls = []
        for _ in range(2):
            sim, url = sim_proc(None, "--time-scale", "1", model=MODEL)
            procs.append(sim.start())
            urls.append(url)
        epp = epp_proc(config={"pools": {"default": {"served_model": MODEL, "replicas": urls}}})
        procs.append(epp.start())
        envoy, base = envoy_proc(epp.picker, edit=_one_request_at_a_time)
        procs.append(envoy.start())
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
        with ThreadPoolExecutor(8) as pool:
            answers = Counter(pool.map(lambda _: _ask(client), range(8)))
        overflow = ("503 1 Envoy's limit on concurrent requests to the replicas (its circuit "
                    "breaker) is reached; retry shortly.")
        assert answers["True"] >= 1 and answers[overflow] >= 1, answers
        assert answers["True"] + answers[overflow] == 8, answers
        failures = metric_values(epp.base, "kvgate_replica_failures_total")
        assert sum(failures.values()) == 0, failures
        assert httpx.get(f"{epp.base}/readyz", timeout=5).status_code == 200
        assert _ask(client) == "True"
        wait_for(lambda: inflight(epp.base) == 0, what="no request in flight")
    finally:
        for proc in reversed(procs):
            proc.stop()
