"""When the picker cannot pick: no ready endpoint (the picker answers 503), and the picker
itself gone (Envoy's ext_proc failure mode, the InferencePool's ``failureMode``):

- FailClose (``failure_mode_allow: false``, kvgate's default bootstrap): Envoy answers 503
  (its ``status_on_error``, a request caught mid-exchange too), OpenAI-shaped by the
  bootstrap's local reply mapper, and nothing reaches a replica;
- FailOpen (``failure_mode_allow: true``, here with an ``override_host`` cluster that can
  route unpicked requests): body-less requests (``GET /v1/models``) go on unpicked to some
  endpoint (Envoy's round robin), without kvgate's routing, tenancy or accounting; a request
  with a body goes on unpicked when Envoy learnt that the picker is gone before it streamed
  the body to it, and is a 503 otherwise (in ``FULL_DUPLEX_STREAMED`` mode a body handed to
  the processor cannot be taken back).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from gateway.epp.envoy import PICKER_DOWN
from tests.support.epp import EppProc, envoy_proc, epp_proc
from tests.support.gateway import wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
BODY = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Stack:
    epp: EppProc
    sim: str
    fail_close: str
    fail_open: str


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(sim.start())
        # an ejected replica stays out 5 s (no half-open trial request during the test)
        config = {"pools": {"default": {"served_model": MODEL, "replicas": [url]}},
                  "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 1,
                             "eject_base_s": 5, "eject_max_s": 5}}
        epp = epp_proc(config=config)
        procs.append(epp.start())
        closed, close_base = envoy_proc(epp.picker)
        opened, open_base = envoy_proc(epp.picker, failure_mode_allow=True,
                                       endpoints=[url.removeprefix("http://")])
        procs += [closed.start(), opened.start()]
        yield Stack(epp, url, close_base, open_base)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _post(base: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=BODY, timeout=10)


def test_no_ready_endpoint_is_a_503_from_the_picker(stack: Stack) -> None:
    httpx.post(f"{stack.sim}/sim/faults", json={"dead": True}, timeout=5)
    try:
        wait_for(lambda: httpx.get(f"{stack.epp.base}/readyz", timeout=5).status_code == 503,
                 what="the picker sees no ready replica")
        resp = _post(stack.fail_close)
        assert resp.status_code == 503
        # the seconds until the ejected replica is tried again (ejected for 5 s)
        assert 1 <= int(resp.headers["retry-after"]) <= 5
        assert resp.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        httpx.post(f"{stack.sim}/sim/faults", json={"dead": False}, timeout=5)
    wait_for(lambda: httpx.get(f"{stack.epp.base}/readyz", timeout=5).status_code == 200,
             timeout=30, what="the replica back")


def _picker_down(resp: httpx.Response) -> None:
    """FailClose's answer, OpenAI-shaped by the bootstrap (Envoy's own was an empty 503, or
    500 mid-exchange, that an SDK reads as no error at all)."""
    assert resp.status_code == 503, resp.text
    assert resp.headers["retry-after"] == "1"
    assert resp.json() == {"error": {"message": PICKER_DOWN, "type": "ServiceUnavailableError",
                                     "param": None, "code": 503}}


def _logged(sim: str) -> int:
    return len(httpx.get(f"{sim}/sim/requests", timeout=5).json()["requests"])


def test_a_killed_picker_is_envoys_failure_mode(stack: Stack) -> None:
    for base in (stack.fail_close, stack.fail_open):
        assert _post(base).headers["x-kvgate-route"]  # picked by kvgate while it runs
        models = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        assert models[0]["owned_by"] == "kvgate"  # kvgate's own list (public names)
    stack.epp.kill()
    before = _logged(stack.sim)
    for _ in range(4):
        _picker_down(_post(stack.fail_close))
    _picker_down(httpx.get(f"{stack.fail_close}/v1/models", timeout=10))
    with pytest.raises(openai.APIStatusError) as caught:
        openai.OpenAI(base_url=f"{stack.fail_close}/v1", api_key="x", max_retries=0) \
            .chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    body = caught.value.body  # the SDK's reading of it: the error object
    assert caught.value.status_code == 503 and isinstance(body, dict), body
    assert body["message"] == PICKER_DOWN
    assert _logged(stack.sim) == before  # FailClose: nothing went on unpicked
    for _ in range(4):
        resp = _post(stack.fail_open)
        assert resp.status_code in (200, 503)
        assert "x-kvgate-route" not in resp.headers
    unpicked = httpx.get(f"{stack.fail_open}/v1/models", timeout=10)
    assert unpicked.status_code == 200  # FailOpen: the replica's own answer
    assert unpicked.json()["data"][0]["owned_by"] == "vllm"


def test_the_first_answer_of_an_engine_outage_is_the_pickers_503_too() -> None:
    """The HTTP edge's rule at the picker: a replica whose engine died answers 500 until its
    server exits; the request that met it (the picker's health has not seen it yet) gets the
    503 with Retry-After the next one gets from the picker, not the engine's 500."""
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(sim.start())
        config = {"pools": {"default": {"served_model": MODEL, "replicas": [url]}},
                  "health": {"interval_s": 60, "timeout_s": 0.5, "failure_threshold": 2,
                             "eject_base_s": 5, "eject_max_s": 5}}  # only requests notice
        epp = epp_proc(config=config)
        procs.append(epp.start())
        envoy, base = envoy_proc(epp.picker)
        procs.append(envoy.start())
        assert _post(base).status_code == 200
        httpx.post(f"{url}/sim/faults", json={"dead": True}, timeout=5)
        answers = [_post(base) for _ in range(2)]
        for resp in answers:
            assert resp.status_code == 503, resp.text
            assert 1 <= int(resp.headers["retry-after"]) <= 5
            assert resp.json()["error"]["type"] == "ServiceUnavailableError"
        assert answers[0].json() == answers[1].json()
    finally:
        for proc in reversed(procs):
            proc.stop()
