"""A replica whose every stream starts with vLLM's error event of code >= 500 (its engine fails
before answering) is judged as one answering 500: each such stream is a failure of that replica
at both edges (the HTTP proxy and the picker behind Envoy), so it is ejected, and the HTTP edge
answers the client from the healthy replica. `test_edges_agree` checks the client's 502 with a
replica failures never eject; this checks the replica's health."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import openai
import pytest

from tests.support.bad_replica import BadReplica, chunked, sse_head, whole
from tests.support.edges import EdgeBases, running_edge
from tests.support.gateway import FAST_HEALTH, metric_values
from tests.support.procs import Proc

ENGINE_ERROR = (b'data: {"error": {"message": "The engine failed.", "type": '
                b'"InternalServerError", "param": null, "code": 500}}\n\ndata: [DONE]\n\n')
ANSWERS = {
    "error-event": sse_head() + chunked(ENGINE_ERROR),
    "500": whole(b'{"error": {"message": "boom", "type": "InternalServerError", '
                 b'"param": null, "code": 500}}', status=500),
}
# no ejection back-off ends during the test: its failures are counted, not readmissions
HEALTH = {**FAST_HEALTH, "eject_base_s": 60, "eject_max_s": 60}


@pytest.fixture
def sim(sim_factory: Callable[..., tuple[Proc, str]]) -> str:
    return sim_factory("--time-scale", "50", model="m")[1]


def _edge(edge: str, replicas: list[str]) -> AbstractContextManager[EdgeBases]:
    """(base of the edge, base of its /metrics)."""
    # round robin: the bad replica is picked until it is ejected (cost-aware routing learns
    # to avoid it first, and it may never be tried twice)
    config = {"pools": {"p": {"served_model": "m", "replicas": replicas}}, "health": HEALTH,
              "routing": {"policy": "round_robin"}}
    return running_edge(edge, config=config)


@pytest.mark.parametrize("answer", list(ANSWERS))
@pytest.mark.parametrize("edge", ["http", "envoy"])
def test_a_replica_failing_every_stream_is_ejected(
        sim: str, edge: str, answer: str) -> None:
    with BadReplica("m", ANSWERS[answer]) as bad, _edge(edge, [bad.url, sim]) as (base, metrics):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        statuses: list[str] = []  # what the client got from the bad replica's tries
        for i in range(12):
            try:
                for _ in client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"hi {i}"}],
                        max_tokens=2, stream=True):
                    pass
            except openai.APIStatusError as exc:  # the picker edge does not retry
                assert edge == "envoy" and exc.status_code in (500, 502), exc
                statuses.append(str(exc.status_code))
        key = f'{{pool="p",replica="{bad.url.removeprefix("http://")}"}}'
        # every stream it was sent is one failure; the threshold (2) ejected it
        assert metric_values(metrics, "kvgate_replica_failures_total")[key] == bad.posts
        assert 2 <= bad.posts <= 3, bad.posts
        assert metric_values(metrics, "kvgate_replica_healthy")[key] == 0
        if edge == "envoy":  # each counted with the status its client got (the picker
            # counted the 502 it answered for an error event as the event's 500)
            assert sorted(statuses) == _counted(metrics, bad.url)


def _counted(metrics: str, replica: str) -> list[str]:
    """The statuses the edge counted for the requests it sent to ``replica``, one each."""
    host = replica.removeprefix("http://")
    return sorted(key.split('status="')[1].split('"')[0]
                  for key, n in metric_values(metrics, "kvgate_requests_total").items()
                  if f'replica="{host}"' in key for _ in range(int(n)))


FIRST_EVENT = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m",'
               b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n')
LONE_ANSWERS = {**ANSWERS, "mid-stream": sse_head() + chunked(FIRST_EVENT + ENGINE_ERROR)}


@pytest.mark.parametrize("answer", list(LONE_ANSWERS))
@pytest.mark.parametrize("edge", ["http", "envoy"])
def test_a_lone_replica_failing_every_request_is_counted_not_ejected(
        edge: str, answer: str) -> None:
    """The pool's only replica answering vLLM's 500 for each request (not its dead engine's)
    is kept in rotation on purpose: no other replica can tell whether the request or the
    replica is at fault, and ejecting it refused every tenant. Its failures were counted
    nowhere (`kvgate_replica_failures_total` stayed 0, and the doctor, which reads it, named
    nothing): they are counted, and it stays in rotation."""
    with BadReplica("m", LONE_ANSWERS[answer]) as bad, _edge(edge, [bad.url]) as (base, metrics):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        for i in range(5):
            with pytest.raises(openai.APIError):
                for _ in client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"hi {i}"}],
                        max_tokens=2, stream=True):
                    pass
        key = f'{{pool="p",replica="{bad.url.removeprefix("http://")}"}}'
        assert bad.posts == 5  # every request reached it: never ejected
        assert metric_values(metrics, "kvgate_replica_failures_total")[key] == 5
        assert metric_values(metrics, "kvgate_replica_attempts_total")[key] == 5
        assert metric_values(metrics, "kvgate_replica_healthy")[key] == 1
