"""Replicas answering vLLM's 500 to everything while another serves (`gateway.error_streaks`),
at both edges (`kvgate serve`; `kvgate epp` behind a real Envoy that walks the picker's
destination, ``epp.fallbacks: 1``) over real simulators. A 500 is tried on one other
replica; a second 500 was the client's answer and charged to neither replica, so two failing
replicas whose retries met each other acquitted each other every time and stayed in
rotation. Routing is
round-robin in id order (the destination: the rotation from its first), so the failing pair's
retries meet each other on every third request (Envoy, as the HTTP edge, tries one other
endpoint)."""

from __future__ import annotations

import openai
import pytest

from tests.support.edges import start_edge
from tests.support.gateway import metric_values
from tests.support.procs import Proc, free_port, sim_proc

MODEL = "sim-model"
THRESHOLD = 2  # health.failure_threshold (the tests' fast health)


EDGES = ["http", "envoy"]


def _fleet(procs: list[Proc], failing: int, edge: str) -> tuple[str, str, list[str]]:
    """Three simulators, the first `failing` of them in id order answering 500 to every
    request, behind `edge`; returns the base its clients use, the base of its /metrics and
    the replicas' ids in that order."""
    ports = sorted((free_port() for _ in range(3)), key=lambda p: f"127.0.0.1:{p}")
    urls = []
    for i, port in enumerate(ports):
        sim, url = sim_proc(port, "--time-scale", "50",
                            *(["--error-rate", "1.0"] if i < failing else []))
        procs.append(sim.start())
        urls.append(url)
    ids = [u.removeprefix("http://") for u in urls]
    config = {
        "pools": {"default": {"served_model": MODEL, "replicas": urls}},
        "routing": {"policy": "round_robin"},
        # only requests judge the replicas, and an ejection lasts the whole test
        "health": {"interval_s": 600, "failure_threshold": THRESHOLD,
                   "eject_base_s": 600, "eject_max_s": 600}}
    base, metrics = start_edge(edge, procs, config=config, picker={"epp": {"fallbacks": 1}},
                               endpoints=ids)
    return base, metrics, ids


def _statuses(base: str, requests: int) -> list[int]:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    out = []
    for i in range(requests):
        try:
            client.completions.create(model=MODEL, prompt=f"request {i}", max_tokens=2)
            out.append(200)
        except openai.APIStatusError as exc:
            out.append(exc.status_code)
    return out


def _healthy(base: str, ids: list[str]) -> list[float]:
    gauge = metric_values(base, "kvgate_replica_healthy")
    return [gauge[f'{{pool="default",replica="{rid}"}}'] for rid in ids]


@pytest.mark.parametrize("edge", EDGES)
def test_failing_replicas_that_acquit_each_other_are_ejected(
    procs: list[Proc], edge: str,
) -> None:
    """The first replica's 500s were only ever retried on the second (also failing): the
    client got the 500 and neither was charged. Before: after two rotations the first was
    still in rotation (only the second's 500s retried on the good replica were charged), and
    it stayed until the second was ejected and its retries met the good one. Now its 500s
    in a row while the good replica served are charged: both are out by then."""
    base, metrics, ids = _fleet(procs, 2, edge)
    statuses = _statuses(base, 6)
    assert statuses.count(500) == 2, statuses  # the rotations starting at the first
    assert _healthy(metrics, ids) == [0.0, 0.0, 1.0]
    assert set(_statuses(base, 4)) == {200}  # the good replica answers everything now


@pytest.mark.parametrize("edge", EDGES)
def test_a_fleet_failing_every_request_ejects_none(procs: list[Proc], edge: str) -> None:
    """Every replica answers 500 (a fleet-wide bug, or a request that fails anywhere): nothing
    served meanwhile tells whose fault it is, so no replica is charged and none leaves (else
    the pool answered 503 to every request, those it would serve included)."""
    base, metrics, ids = _fleet(procs, 3, edge)
    assert set(_statuses(base, 12)) == {500}
    assert _healthy(metrics, ids) == [1.0, 1.0, 1.0]
    failures = metric_values(metrics, "kvgate_replica_failures_total")
    assert sum(failures.values()) == 0
