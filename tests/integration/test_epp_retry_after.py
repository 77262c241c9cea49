"""The picker's 503 when the data plane's subset hint allows only replicas that are out: why
and Retry-After are those of the allowed replicas (the HTTP edge's rule, `Pool.retry_after`),
not of the whole pool -- whose other replica is fine, which said "Retry-After: 1" while the
allowed one was ejected for many seconds. Real simulators, picker and Envoy; the official
openai client."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import metric_values, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
SUBSET = "x-test-subset"
SimFactory = Callable[..., tuple[Proc, str]]
# probes often, and a replica found down stays out 20 s: a Retry-After well above 1
HEALTH = {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2,
          "eject_base_s": 20.0, "eject_max_s": 20.0}


def test_a_subset_of_replicas_that_are_out_gets_their_retry_after(
    sim_factory: SimFactory,
) -> None:
    dead_proc, dead = sim_factory("--time-scale", "20")
    _, live = sim_factory("--time-scale", "20")
    epp = epp_proc(config={"pools": {"default": {"served_model": MODEL,
                                                 "replicas": [dead, live]}},
                           "health": HEALTH})
    with epp.start():
        eps = [u.removeprefix("http://") for u in (dead, live)]
        envoy, base = envoy_proc(epp.picker, endpoints=eps, subset_header=SUBSET)
        with envoy.start():
            dead_proc.kill()
            key = f'{{pool="default",replica="{eps[0]}"}}'
            wait_for(lambda: metric_values(epp.base, "kvgate_replica_healthy")[key] == 0.0,
                     what="the picker finds the replica down")
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                   timeout=10, default_headers={SUBSET: eps[0]})
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            resp = caught.value.response
            assert resp.status_code == 503
            error = resp.json()["error"]
            assert error["type"] == "ServiceUnavailableError"
            assert "(1 replica: cannot connect)" in error["message"], error
            assert int(resp.headers["retry-after"]) > 5  # the ejection's 20 s, less the wait
            # the whole pool is served meanwhile
            ok = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
                "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            assert ok.status_code == 200
