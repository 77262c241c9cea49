"""Every endpoint of the picker's destination refuses its connection, behind a real Envoy whose
cluster walks the list (``override_host``, ``epp.fallbacks: 1``). Health polling is slow: the
picker learns what happened from Envoy's answer alone.

Before: Envoy's last try was marked down, the endpoint it went past before was charged one
failure only, and the client got the 502 "The replica did not answer." though no replica was
left -- the next request was sent to the one still counted up, and refused again. Envoy also
went on past the list's end (its round robin over the whole cluster), to endpoints the data
plane's subset hint had excluded. Now the endpoints Envoy went past are asked for a connection
themselves and marked down too: the client gets the pool's 503 naming the cause (``2 cannot
connect``, Retry-After), as at the HTTP edge, and the next request is refused by the picker
without one more connection tried; and Envoy's retries stay on the picker's list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import metric_values, request_statuses, wait_for
from tests.support.procs import Proc, start_sims

MODEL = "sim-model"
SUBSET = "x-test-subset"


@dataclass
class Stack:
    sims: list[Proc]  # the replicas
    eps: list[str]  # ... their endpoints
    base: str  # Envoy's listener
    admin: str  # ... and its admin port
    picker: str  # the picker's HTTP port


def _stack(procs: list[Proc], n: int, *sim_args: str, interval_s: float = 60) -> Stack:
    """`n` replicas behind the picker (one fallback) and Envoy; health polling every
    `interval_s`."""
    sims, urls = start_sims(procs, n, "--time-scale", "20", *sim_args, model=MODEL)
    eps = [url.removeprefix("http://") for url in urls]
    epp = epp_proc(config={
        "pools": {"default": {"served_model": MODEL, "replicas": [f"http://{e}" for e in eps]}},
        "epp": {"fallbacks": 1}, "health": {"interval_s": interval_s, "failure_threshold": 5}})
    procs.append(epp.start())
    envoy, base = envoy_proc(epp.picker, endpoints=eps, subset_header=SUBSET)
    procs.append(envoy.start())
    assert envoy.ready_url is not None
    return Stack(sims, eps, base, envoy.ready_url.removesuffix("/ready"), epp.base)


def _connect_failures(admin: str) -> int:
    stats = httpx.get(f"{admin}/stats", params={"filter": "kvgate_pool.upstream_cx_connect_fail$"},
                      timeout=10).text
    return int(stats.rsplit(":", 1)[1])


def test_a_pool_whose_replicas_all_refuse_is_the_pools_503(procs: list[Proc]) -> None:
    stack = _stack(procs, 2)
    client = openai.OpenAI(base_url=f"{stack.base}/v1", api_key="unused", max_retries=0)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    for sim in stack.sims:
        sim.kill()
    for _ in range(2):  # the first finds them gone; the second is refused by the picker
        with pytest.raises(openai.APIStatusError) as gone:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert gone.value.status_code == 503
        error = gone.value.response.json()["error"]
        assert error["type"] == "ServiceUnavailableError"
        assert error["message"] == (f"No healthy replica for the model `{MODEL}` "
                                    "(2 replicas: 2 cannot connect).")
        assert gone.value.response.headers["retry-after"]
        if _ == 0:
            tried = _connect_failures(stack.admin)
    assert _connect_failures(stack.admin) == tried  # not sent to a dead replica again
    healthy = metric_values(stack.picker, "kvgate_replica_healthy")
    assert sorted(healthy.values()) == [0.0, 0.0], healthy
    assert request_statuses(stack.picker) == {"200": 1, "503": 2}
    # no request succeeded on a fallback (the one Envoy moved to refused it too)
    assert sum(metric_values(stack.picker, "kvgate_failovers_total").values()) == 0


def test_envoys_retries_stay_on_the_pickers_list(procs: list[Proc]) -> None:
    """The data plane allows one endpoint, which refuses: Envoy tries it alone (it went on
    to the other endpoint, outside the subset, and served the request there)."""
    stack = _stack(procs, 2)
    stack.sims[0].kill()
    resp = httpx.post(f"{stack.base}/v1/completions", headers={SUBSET: stack.eps[0]}, timeout=30,
                      json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"] == (f"No healthy replica for the model `{MODEL}` "
                                               "(1 replica: cannot connect).")
    assert _connect_failures(stack.admin) == 1
    # the other replica serves what the subset allows it
    resp = httpx.post(f"{stack.base}/v1/completions", headers={SUBSET: stack.eps[1]},
                      timeout=30, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert resp.status_code == 200
    assert resp.headers["x-kvgate-replica"] == f"default/{stack.eps[1]}"


def test_a_stored_response_is_asked_of_its_replica_only(procs: list[Proc]) -> None:
    """The replica holding a stored response refuses its connection: the HTTP edge's 502
    "The replica holding this response did not answer." (Envoy retried the GET on the other
    replica, round robin: its 404 "not found" was relayed as the holder's answer)."""
    stack = _stack(procs, 2, "--enable-store")
    client = openai.OpenAI(base_url=f"{stack.base}/v1", api_key="unused", max_retries=0)
    created = client.responses.with_raw_response.create(model=MODEL, input="x",
                                                        max_output_tokens=4)
    stored = created.parse()
    home = created.headers["x-kvgate-replica"].removeprefix("default/")
    assert client.responses.retrieve(stored.id).id == stored.id
    stack.sims[stack.eps.index(home)].kill()
    with pytest.raises(openai.APIStatusError) as gone:
        client.responses.retrieve(stored.id)
    assert gone.value.status_code == 502, gone.value.response.text
    assert gone.value.response.json()["error"]["message"] == (
        "The replica holding this response did not answer.")
    assert _connect_failures(stack.admin) == 1


def test_a_refused_first_choice_is_marked_down_at_once(procs: list[Proc]) -> None:
    """Envoy goes past the first endpoint, which refuses, to the fallback, which answers: the
    first one is down at once, as at the HTTP edge (it was counted one failure, and picked
    first again until `health.failure_threshold` requests had gone past it)."""
    stack = _stack(procs, 2)
    client = openai.OpenAI(base_url=f"{stack.base}/v1", api_key="unused", max_retries=0)
    pinned: Any = [{"role": "system", "content": "pinned " * 400},
                   {"role": "user", "content": "first"}]
    home = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=pinned, max_tokens=2).headers["x-kvgate-replica"]
    dead = home.removeprefix("default/")
    stack.sims[stack.eps.index(dead)].kill()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=pinned, max_tokens=2)
    assert raw.parse().choices and raw.headers["x-kvgate-route"] == "retry"
    wait_for(lambda: metric_values(stack.picker, "kvgate_replica_healthy")[
        f'{{pool="default",replica="{dead}"}}'] == 0, what="the refused replica down")
    for _ in range(3):  # not tried first any more
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=pinned, max_tokens=2)
        assert raw.parse().choices and raw.headers["x-kvgate-route"] != "retry"
    assert _connect_failures(stack.admin) == 1


def test_a_request_envoy_moved_on_is_not_cut_when_its_first_choice_is_found_down(
    procs: list[Proc],
) -> None:
    """The first choice refuses, Envoy sends the request to the fallback, and health polling
    finds the first choice down while the fallback answers: the answer is the fallback's (the
    picker ended the request as its replica's stalled one, the 504 "The replica stopped
    making progress", while the fallback was generating it)."""
    stack = _stack(procs, 2, "--time-scale", "1", interval_s=0.5)
    client = openai.OpenAI(base_url=f"{stack.base}/v1", api_key="unused", max_retries=0)
    pinned = "pinned " * 400  # (its cached prefix makes its replica the first choice)
    home = client.completions.with_raw_response.create(
        model=MODEL, prompt=pinned, max_tokens=2).headers["x-kvgate-replica"]
    stack.sims[stack.eps.index(home.removeprefix("default/"))].kill()
    raw = client.completions.with_raw_response.create(  # (long enough for health polls)
        model=MODEL, prompt=pinned, max_tokens=300, extra_body={"ignore_eos": True})
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.completion_tokens == 300
    assert raw.headers["x-kvgate-route"] == "retry"  # Envoy went past the first choice
    assert request_statuses(stack.picker) == {"200": 2}
