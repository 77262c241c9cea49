"""Envoy ext_proc filter settings the picker cannot pick in, shown in its log and counted
(``kvgate_epp_misconfigured_total{setting}``), a real Envoy in front of a real picker.

- ``observability_mode: true``: Envoy sends the messages and does not wait for answers, so
  the request goes where its route sends it before any pick. The picker showed nothing: it
  answered into the void, and counted a 503 for a request the replica answered 200. Now it
  answers nothing, counts no request, leases no replica, says the misconfiguration once in
  its log and counts each such request.
- ``response_header_mode: SKIP``: said once in the log already; now counted too, once per
  request (not per body chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from tests.integration.test_epp_processing_modes import _modes
from tests.support.epp import EppProc, envoy_proc, epp_proc
from tests.support.gateway import inflight, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
COUNTER = "kvgate_epp_misconfigured_total"


def _observing(config: dict[str, Any]) -> None:
    (listener,) = config["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in manager["http_filters"]
                   if f["name"] == "envoy.filters.http.ext_proc"]
    ext_proc["typed_config"]["observability_mode"] = True


@pytest.fixture
def start() -> Iterator[Callable[[Callable[[dict[str, Any]], None]], tuple[EppProc, str]]]:
    procs: list[Proc] = []

    def run(edit: Callable[[dict[str, Any]], None]) -> tuple[EppProc, str]:
        sim, url = sim_proc(None, model=MODEL)
        procs.append(sim.start())
        epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}})
        procs.append(epp.start())
        # the replica listed in Envoy's cluster: unpicked, a request still reaches it
        envoy, base = envoy_proc(epp.picker, edit=edit,
                                 endpoints=[url.removeprefix("http://")])
        procs.append(envoy.start())
        return epp, base

    yield run
    for proc in reversed(procs):
        proc.stop()


def _count(epp: EppProc, setting: str) -> float:
    return metric_values(epp.base, COUNTER).get(f'{{setting="{setting}"}}', 0.0)


def test_observability_mode_is_said_and_counted_not_picked(
    start: Callable[[Callable[[dict[str, Any]], None]], tuple[EppProc, str]],
) -> None:
    epp, base = start(_observing)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    done = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert done.choices[0].text  # Envoy routed it on its own
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                            stream=True))
    assert chunks
    wait_for(lambda: _count(epp, "observability_mode") == 2, 30, "both requests counted")
    wait_for(lambda: "runs in observability_mode" in epp.output(None), 30,
             "the misconfiguration in the picker's log")
    assert epp.output(None).count("runs in observability_mode") == 1  # once, not per request
    assert metric_values(epp.base, "kvgate_requests_total") == {}  # the picker served none
    assert inflight(epp.base) == 0


def test_skipped_response_headers_are_counted_once_per_request(
    start: Callable[[Callable[[dict[str, Any]], None]], tuple[EppProc, str]],
) -> None:
    epp, base = start(_modes(response_header_mode="SKIP"))
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    # a stream of many chunks: one request, one count
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=16,
                                            stream=True))
    assert len(chunks) > 2
    wait_for(lambda: inflight(epp.base) == 0, 30, "the exchange settled")
    assert _count(epp, "response_header_mode") == 1
