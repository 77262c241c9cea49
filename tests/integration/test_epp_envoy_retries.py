"""Envoy's own retries are counted by the picker. Behind a real Envoy whose cluster walks the
picker's list (``override_host``, ``epp.fallbacks: 1``), a replica that refuses connections is
gone past to the next endpoint; health polling is slow, so only Envoy's retries find it.

Before: the picker counted no retry (`kvgate_upstream_retries_total` had no series), so an
operator saw Envoy's retries in Envoy's stats only. Now each endpoint Envoy went past is one
``reason="envoy"`` retry, as many as Envoy's ``upstream_rq_retry`` stat counts.
"""

from __future__ import annotations

import httpx
import openai

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import metric_values, request_statuses
from tests.support.procs import Proc, start_sims

MODEL = "sim-model"


def _envoy_retries(admin: str) -> int:
    stats = httpx.get(f"{admin}/stats", params={"filter": "kvgate_pool.upstream_rq_retry$"},
                      timeout=10).text
    return int(stats.rsplit(":", 1)[1])


def _picker_retries(picker: str) -> dict[str, float]:
    return {k: v for k, v in metric_values(picker, "kvgate_upstream_retries_total").items()
            if v}


def test_envoys_retries_are_counted_by_the_picker(procs: list[Proc]) -> None:
    sims, urls = start_sims(procs, 2, "--time-scale", "20", model=MODEL)
    eps = [url.removeprefix("http://") for url in urls]
    epp = epp_proc(config={
        "pools": {"default": {"served_model": MODEL, "replicas": [f"http://{e}" for e in eps]}},
        "epp": {"fallbacks": 1}, "health": {"interval_s": 60, "failure_threshold": 5},
        # picks alternate: half the requests after the kill pick the dead replica first (the
        # cost model's pick of a one-token prompt may stay on the live one for all four)
        "routing": {"policy": "round_robin"}})
    procs.append(epp.start())
    envoy, base = envoy_proc(epp.picker, endpoints=eps)
    procs.append(envoy.start())
    assert envoy.ready_url is not None
    admin = envoy.ready_url.removesuffix("/ready")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    for _ in range(2):  # both replicas serve: nothing retried
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    assert _envoy_retries(admin) == 0 and _picker_retries(epp.base) == {}

    sims[0].kill()
    for _ in range(4):  # the one picked first with the dead one first is served by the other
        assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    went_past = _envoy_retries(admin)
    assert went_past >= 1, "the setup: Envoy went past the dead replica"
    assert _picker_retries(epp.base) == {'{pool="default",reason="envoy"}': went_past}
    assert request_statuses(epp.base) == {"200": 6}

    sims[1].kill()  # the last one refuses too: Envoy goes past nothing it had not tried
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    except openai.APIStatusError as exc:
        assert exc.status_code in (502, 503), exc
    assert _picker_retries(epp.base) == {
        '{pool="default",reason="envoy"}': _envoy_retries(admin)}
