"""Envoy's own answers made after the picker sent the request on, by something other than its
router: a filter after the picker's (here an authorization filter, RBAC, refusing requests with
``x-blocked``), and a route to a cluster with no healthy endpoint (Envoy's 503 "no healthy
upstream"). No replica was asked; Envoy says so in the ``response.code_details`` response
attribute the bootstrap asks for.

Before, the picker judged them as the replica's answers: the 403 marked the replica down (the
client got the 502 "The replica refused the gateway's credentials", and every later request
the 503 "No healthy replica"); each 503 counted a failure, until the replica was ejected.
Now they pass with their status, their text as an OpenAI-shaped message; the replica is
neither judged nor charged, and serves the next request.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import inflight, metric_values, request_statuses
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
_FILTERS = "type.googleapis.com/envoy.extensions.filters.http"


def _after_the_picker(config: dict[str, Any]) -> None:
    """RBAC denying ``x-blocked`` between the picker's filter and the router; requests with
    ``x-nowhere`` routed to a cluster without endpoints."""
    resources = config["static_resources"]
    hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(-1, {"name": "envoy.filters.http.rbac", "typed_config": {
        "@type": f"{_FILTERS}.rbac.v3.RBAC",
        "rules": {"action": "DENY", "policies": {"blocked": {
            "permissions": [{"header": {"name": "x-blocked", "present_match": True}}],
            "principals": [{"any": True}]}}}}})
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routes.insert(0, {"match": {"prefix": "/", "headers": [
        {"name": "x-nowhere", "present_match": True}]}, "route": {"cluster": "nowhere"}})
    resources["clusters"].append({
        "name": "nowhere", "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "nowhere", "endpoints": []}})


def test_envoys_own_answers_after_the_picker_blame_no_replica(procs: list[Proc]) -> None:
    sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
    procs.append(sim.start())
    # slow health polling: a replica judged down or ejected stays so for the test
    epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}},
                           "health": {"interval_s": 60, "failure_threshold": 3}})
    procs.append(epp.start())
    envoy, base = envoy_proc(epp.picker, edit=_after_the_picker)
    procs.append(envoy.start())
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    for _ in range(2):
        with pytest.raises(openai.PermissionDeniedError) as denied:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                      extra_headers={"x-blocked": "1"})
        assert denied.value.response.json()["error"]["message"] == "RBAC: access denied"
        assert denied.value.request_id  # (the picker's x-request-id, in its log line)
    for _ in range(4):  # more than the failure threshold
        with pytest.raises(openai.InternalServerError) as nowhere:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                      extra_headers={"x-nowhere": "1"})
        assert nowhere.value.status_code == 503
        error = nowhere.value.response.json()["error"]
        assert error["message"] == "no healthy upstream"
        assert error["type"] == "ServiceUnavailableError"
    # the replica was never asked, and is neither down nor charged
    answer = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=2)
    assert answer.parse().choices and answer.headers["x-kvgate-replica"] == f"p/{url[7:]}"
    assert request_statuses(epp.base) == {"403": 2, "503": 4, "200": 1}
    assert list(metric_values(epp.base, "kvgate_replica_failures_total").values()) == [0.0]
    assert inflight(epp.base) == 0
