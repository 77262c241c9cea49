"""Envoy's circuit breakers, as kvgate's bootstrap sets them (`envoy_config(max_requests=)`):
the replicas' cluster takes `max_requests` requests at once and as many waiting for a
connection, the picker's cluster three times as many streams. Envoy's defaults (1,024 each)
silently capped a fleet; the limit is rendered from the option, so here it is 1 and each
breaker is reached with a few requests -- which an Envoy with the default limits all serves.

Past the replicas' limit Envoy sends nothing and answers its own 503 "... reset reason:
overflow": the picker makes it a 503 with Retry-After and charges no replica (charged, a busy
pool's healthy replicas were all ejected within a few overflows). Past the picker's, the
bootstrap's local reply says so, a 503 with Retry-After (not "the picker is unavailable").
"""

from __future__ import annotations

import socket
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

import httpx
import pytest

from gateway.config import UpstreamConfig
from gateway.epp.envoy import AT_LIMIT
from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import inflight, metric_values, wait_for
from tests.support.procs import Proc, sim_proc, start_sims

MODEL = "sim-model"
STREAM = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True}
REPLICAS_FULL = ("Envoy's limit on concurrent requests to the replicas (its circuit breaker) "
                 "is reached; retry shortly.")


@dataclass
class Edge:
    base: str  # Envoy's listener
    admin: str  # Envoy's admin interface

    def stat(self, name: str) -> int:
        text = httpx.get(f"{self.admin}/stats", params={"filter": f"^{name}$"}, timeout=5).text
        return int(text.split(":")[1]) if text.strip() else 0


@dataclass
class Stack:
    limited: Edge  # max_requests=1
    default: Edge
    picker: str  # the picker's HTTP port


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Proc] = []
    try:
        # every stream stops after its first token and stays open until the client leaves
        sim, url = sim_proc(None, "--time-scale", "50", "--hang-after-tokens", "1", model=MODEL)
        procs.append(sim.start())
        epp = epp_proc(config={"pools": {"default": {"served_model": MODEL, "replicas": [url]}}})
        procs.append(epp.start())
        edges = []
        variants: list[dict[str, Any]] = [{"max_requests": 1}, {}]
        for options in variants:
            proxy, base = envoy_proc(epp.picker, **options)
            procs.append(proxy.start())
            assert proxy.ready_url is not None
            edges.append(Edge(base, proxy.ready_url.removesuffix("/ready")))
        yield Stack(edges[0], edges[1], epp.base)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _stream(held: ExitStack, base: str) -> tuple[int, str, str]:
    """(status, Retry-After, first line) of a stream, left open in `held` when it is a 200."""
    client = held.enter_context(httpx.Client(timeout=30))
    resp = held.enter_context(client.stream("POST", f"{base}/v1/completions", json=STREAM))
    if resp.status_code != 200:
        resp.read()
        message: str = resp.json()["error"]["message"]
        return resp.status_code, resp.headers.get("retry-after", ""), message
    lines = cast(Generator[str, None, None], resp.iter_lines())
    held.callback(lines.close)  # dropped, the generator would close the connection
    return 200, "", next(lines)[:6]


def _uploading(held: ExitStack, base: str) -> None:
    """A request whose body has only begun: the picker holds it (and its stream) for the rest."""
    url = urlsplit(base)
    assert url.hostname is not None and url.port is not None
    sock = held.enter_context(socket.create_connection((url.hostname, url.port), timeout=10))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")


def test_past_the_replicas_limit_a_503_that_charges_no_replica(stack: Stack) -> None:
    edge = stack.limited
    with ExitStack() as first, ExitStack() as second, ExitStack() as third, \
            ThreadPoolExecutor(1) as pool:
        assert _stream(first, edge.base) == (200, "", "data: ")
        waiting = pool.submit(_stream, second, edge.base)  # for the one connection
        wait_for(lambda: edge.stat("cluster.kvgate_pool.upstream_rq_pending_active") == 1,
                 what="a request waiting for a connection to the replica")
        assert _stream(third, edge.base) == (503, "1", REPLICAS_FULL)
        first.close()  # the connection is free: the waiting request goes
        assert waiting.result(timeout=30) == (200, "", "data: ")
    failures = metric_values(stack.picker, "kvgate_replica_failures_total")
    assert sum(failures.values()) == 0, failures
    assert httpx.get(f"{stack.picker}/readyz", timeout=5).status_code == 200
    wait_for(lambda: inflight(stack.picker) == 0, what="no request in flight")


def test_past_the_pickers_limit_a_503_that_says_so(stack: Stack) -> None:
    edge = stack.limited
    with ExitStack() as held:
        for _ in range(3):  # the picker's cluster: 3 x max_requests streams
            _uploading(held, edge.base)
        wait_for(lambda: edge.stat("cluster.kvgate_epp.upstream_rq_active") == 3,
                 what="three streams to the picker")
        with ExitStack() as probe:
            assert _stream(probe, edge.base) == (503, "1", AT_LIMIT)
    wait_for(lambda: edge.stat("cluster.kvgate_epp.upstream_rq_active") == 0,
             what="the streams to the picker ended")
    with ExitStack() as probe:
        assert _stream(probe, edge.base) == (200, "", "data: ")


def test_with_the_default_limits_all_pass(stack: Stack) -> None:
    edge = stack.default
    with ExitStack() as held:
        for _ in range(3):
            _uploading(held, edge.base)
        wait_for(lambda: edge.stat("cluster.kvgate_epp.upstream_rq_active") == 3,
                 what="three streams to the picker")
        answers = [_stream(held, edge.base) for _ in range(3)]
        assert answers == [(200, "", "data: ")] * 3
        assert edge.stat("cluster.kvgate_pool.upstream_rq_active") == 3
    wait_for(lambda: inflight(stack.picker) == 0, what="no request in flight")


@pytest.mark.parametrize(("upstream", "failover"), [
    (UpstreamConfig(), True),
    (UpstreamConfig(retry_budget_ratio=0, retry_budget_min=0), False),  # no retry, ever
])
def test_failover_spends_upstreams_retry_budget(upstream: UpstreamConfig, failover: bool) -> None:
    """The replicas' cluster's retry budget is `upstream`'s: a dead first choice is passed over
    within it (Envoy's own default, 3 retries at once, capped failover fleet-wide)."""
    procs: list[Proc] = []
    try:
        sims, urls = start_sims(procs, 2, "--time-scale", "50", model=MODEL)
        # no probe for a minute: the picker learns that a replica died from Envoy
        epp = epp_proc(config={
            "pools": {"default": {"served_model": MODEL, "replicas": urls}},
            "epp": {"fallbacks": 1}, "health": {"interval_s": 60, "failure_threshold": 5}})
        procs.append(epp.start())
        proxy, base = envoy_proc(epp.picker, upstream=upstream,
                                 endpoints=[u.removeprefix("http://") for u in urls])
        procs.append(proxy.start())
        assert proxy.ready_url is not None
        edge = Edge(base, proxy.ready_url.removesuffix("/ready"))
        body = {"model": MODEL, "prompt": "pinned " * 400, "max_tokens": 2}
        first = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        assert first.status_code == 200
        home = first.headers["x-kvgate-replica"].removeprefix("default/")
        next(s for s, u in zip(sims, urls, strict=True) if u.endswith(home)).kill()
        again = httpx.post(f"{base}/v1/completions", json=body, timeout=10)
        if failover:
            assert again.status_code == 200, again.text
            assert again.headers["x-kvgate-replica"] != first.headers["x-kvgate-replica"]
            assert edge.stat("cluster.kvgate_pool.upstream_rq_retry_overflow") == 0
        else:
            assert again.status_code >= 500, again.text
            assert edge.stat("cluster.kvgate_pool.upstream_rq_retry_overflow") == 1
    finally:
        for proc in reversed(procs):
            proc.stop()
