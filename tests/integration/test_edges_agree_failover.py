"""The two edges judge replicas alike where a request meets more than one failure: a stream
whose error event is followed by a cut or by the client leaving, endpoints passed over before
a 500 (refused, or the 500 then cut or too large), and a 500 whose retry got no answer. Each
case runs at the HTTP proxy (`kvgate serve`) and at the picker behind a real Envoy, over
scripted replicas (`tests/support/bad_replica.py`); the judgement is read from each edge's
/metrics."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from tests.support.bad_replica import BadReplica, End, chunked, sse_head, whole
from tests.support.edges import running_edge
from tests.support.gateway import (
    FAST_HEALTH,
    metric_values,
    request_statuses,
    wait_for,
)

EDGES = ["http", "envoy"]
LIMIT = 64 * 1024  # upstream.max_answer_bytes
# no health poll or ejection back-off ends during a test: what is read is the requests' doing
HEALTH = {**FAST_HEALTH, "interval_s": 60, "eject_base_s": 60, "eject_max_s": 60}
GOOD = b'data: {"id": "c", "object": "chat.completion.chunk", "choices": []}\n\n'
# vLLM's error event for one request (not its dead engine's), without its [DONE]
ERROR_EVENT = (b'data: {"error": {"message": "boom", "type": "InternalServerError", '
               b'"param": null, "code": 500}}\n\n')
BOOM = {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}
E500 = whole(b'{"error": {"message": "boom", "type": "InternalServerError", "param": null, '
             b'"code": 500}}', status=500)


@contextmanager
def _edge(edge: str, replicas: list[str], health: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(base of the edge, base of its /metrics) over `replicas`, tried in their order."""
    config = {"pools": {"p": {"served_model": "m", "replicas": replicas}}, "health": health,
              "routing": {"policy": "round_robin"}, "upstream": {"max_answer_bytes": LIMIT}}
    # behind Envoy the destination lists every replica, Envoy walks it on retries (as the
    # HTTP edge tries up to `upstream.max_attempts`, 3)
    with running_edge(edge, config=config, picker={"epp": {"fallbacks": 2}},
                      endpoints=[url.removeprefix("http://") for url in replicas]) as bases:
        yield bases


def _of(metrics: str, name: str, replica: BadReplica) -> float | None:
    key = f'{{pool="p",replica="{replica.url.removeprefix("http://")}"}}'
    return metric_values(metrics, name).get(key)


# -- (1) a stream whose error event is followed by a cut, or by the client leaving ----------
@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("how", ["clean-end", "client-leaves", "reset"])
def test_a_stream_after_its_error_event_is_judged_by_the_event(edge: str, how: str) -> None:
    """The pool's only replica sends a good event, then vLLM's error event for the request
    (code 500, not a dead engine's), then no [DONE]: its stream ends cleanly, hangs (the SDK
    raises at the event and leaves), or breaks. The event was the answer: the request counts
    500 and the replica one failure, not charged (the lone replica's rule; failure threshold
    1 would eject it) -- at both edges. The HTTP edge counted a client leaving there 499 and
    left the replica unjudged, and charged a break (the lone replica ejected, the client sent
    a second error event after the first); the picker judged both by the event. A break
    behind Envoy is a broken connection for the client (gateway/epp/README.md)."""
    rest = chunked(ERROR_EVENT, last=how == "clean-end")
    end: End = "close" if how == "reset" else "keep"
    with BadReplica("m", sse_head() + chunked(GOOD, last=False), end) as bad, _edge(
            edge, [bad.url], {**HEALTH, "failure_threshold": 1}) as (base, metrics):
        bad.rest, bad.gate = rest, threading.Event()
        got = b""
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=10, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}],
                "stream": True}) as resp:
            chunks = resp.iter_raw()
            got = next(chunks)
            assert got == GOOD  # the stream has started
            bad.gate.set()
            if how == "reset" and edge == "envoy":
                with pytest.raises(httpx.RemoteProtocolError):
                    list(chunks)
                return  # (Envoy tells the picker nothing of the reset: its judgement may vary)
            for chunk in chunks:
                got += chunk
                if how == "client-leaves" and b"boom" in got:
                    break  # as the SDKs do: they raise at the error event
        assert got == GOOD + ERROR_EVENT  # the replica's event, no other after it
        wait_for(lambda: request_statuses(metrics) == {"500": 1.0}, what="the request counted 500")
        assert _of(metrics, "kvgate_replica_failures_total", bad) == 1
        assert _of(metrics, "kvgate_replica_healthy", bad) == 1


# -- (2, 3) the endpoints passed over before a 500 -------------------------------------------
def _polled(metrics: str, replica: BadReplica) -> None:
    wait_for(lambda: _of(metrics, "kvgate_replica_healthy", replica) == 1,
             what="the replica polled healthy")


@contextmanager
def _three(edge: str) -> Iterator[tuple[str, str, list[BadReplica]]]:
    """An edge over three replicas: its base, its /metrics, the replicas in the order the
    next request tries them (its destination list behind Envoy, which walks it on retries:
    two at most, so each is tried once)."""
    ok = whole(b'{"id": "x", "object": "chat.completion", "choices": []}')
    with BadReplica("m", ok, "close") as a, BadReplica("m", ok, "close") as b, BadReplica(
            "m", ok, "close") as c, _edge(edge, [a.url, b.url, c.url], HEALTH) as (
            base, metrics):
        replicas = [a, b, c]
        for replica in replicas:  # polled healthy (and not polled again)
            _polled(metrics, replica)
        # round robin: each request starts one further; the first tried answers (and closes
        # the connection: none is kept for later)
        turns = []
        for _ in range(2):
            resp = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}]})
            assert resp.status_code == 200, resp.text
            named = resp.headers["x-kvgate-replica"].removeprefix("p/")
            turns.append(next(r for r in replicas if r.url.endswith(named)))
        last = next(r for r in replicas if r not in turns)
        yield base, metrics, [last, *turns]


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("answer", ["500", "500-too-large", "500-cut"])
def test_a_refused_replica_passed_over_before_a_500_counts_against_it(
    edge: str, answer: str,
) -> None:
    """The first replica's connection is refused, the second answers vLLM's 500 for the
    request, the third 500 too: vLLM's (relayed), one past `upstream.max_answer_bytes`, or
    one cut mid-body. The HTTP
    edge marks the refused replica down at once whatever the answer was; behind Envoy the
    replicas passed over were not charged when the answer was vLLM's 500 (they most likely
    failed it alike: Envoy retries a 500), nor when that 500 was too large or cut. The picker
    now charges the passed-over ones whenever the 500 is not judged, and asks those it does
    not charge for a connection, marking down the ones that refuse it."""
    answers = {"500": E500,
               "500-too-large": whole(b'{"error": "' + b"a" * LIMIT + b'"}', status=500),
               "500-cut": E500[:-20]}
    with _three(edge) as (base, metrics, (gone, bad, worse)):
        gone.refuse()
        bad.answer = worse.answer = E500
        worse.answer = answers[answer]
        if answer == "500-cut":  # its head and a part of its body, a part more, then the end
            worse.drip, worse.drip_s, worse.end = [E500[-20:-10]], 0.3, "close"
        resp = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == (500 if answer == "500" else 502), resp.text
        if answer == "500":
            assert resp.json()["error"] == BOOM
            wait_for(lambda: _of(metrics, "kvgate_replica_healthy", gone) == 0,
                     what="the refused replica marked down")
        wait_for(lambda: _of(metrics, "kvgate_replica_failures_total", gone) == 1,
                 what="the refused replica charged")


# -- (4) a 500 whose retry got no answer -----------------------------------------------------
@pytest.mark.parametrize("edge", EDGES)
def test_a_500_whose_retry_is_refused(edge: str) -> None:
    """The first replica answers vLLM's 500 for the request, the retries' connections are
    refused. The HTTP edge answers the 500 as the replica sent it (it answered a 502 "The
    replica did not answer.", which says less), counted against that replica, not charged
    (nothing told whose fault it was). Behind Envoy the picker never sees that 500 (Envoy
    drops an answer it retries): it answers the retry's failure, the 502, and charges the
    replica Envoy went past (gateway/epp/README.md)."""
    with _three(edge) as (base, metrics, (bad, gone, gone_too)):
        bad.answer = E500
        gone.refuse()
        gone_too.refuse()
        posts = bad.posts
        resp = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]})
        wait_for(lambda: _of(metrics, "kvgate_replica_healthy", gone_too) == 0,
                 what="the refused replica down")  # (at once)
        assert bad.posts == posts + 1
        if edge == "envoy":
            assert resp.status_code == 502, resp.text
            assert resp.json()["error"]["message"] == "The replica did not answer."
            return
        assert resp.status_code == 500, resp.text
        assert resp.json()["error"] == BOOM
        assert request_statuses(metrics) == {"200": 2.0, "500": 1.0}
        assert _of(metrics, "kvgate_replica_failures_total", bad) == 1
        assert _of(metrics, "kvgate_replica_healthy", bad) == 1
