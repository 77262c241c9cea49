"""The connection between Envoy and the picker, kept alive by HTTP/2 pings (a real Envoy).

- A picker that stops answering without closing the connection (here: its process frozen;
  in production a node or a network gone) left every request waiting for the ext_proc
  `message_timeout` (1000 s): the client's own timeout ran out with no answer. The bootstrap's
  pings on the picker's cluster (`PICKER_KEEPALIVE`) find it and close the connection: the
  request gets the FailClose 503, and the picker serves again once it resumes.
- Envoy frozen with a request in flight: the exchange waits for its answer and sends
  nothing, so TCP never found the connection gone, and the replica's in-flight count (and the
  tenant's concurrency lease) stayed held. The picker's own pings find it and end the
  exchange (499).
- ... before the replica could be judged stalled for it: the request's lease stays while the
  replica's token counters stand still (it finished the answer the frozen Envoy holds, or
  never got the request), the stall rule's evidence. With `health.stall_after_s` shorter than
  the pings' 30 s, the picker ended the request with a 504 and ejected the healthy replica
  (its pool's only one: every other client's 503); its pings now follow `stall_after_s`.
  Another Envoy sharing the picker serves on meanwhile.
- Envoy's pings reach a picker with an exchange that sends nothing for a while (a
  non-streamed generation: no message until its answer's head). gRPC's server took one ping
  every 5 minutes without data, and dropped the connection with a GOAWAY "too_many_pings"
  past that, the request with it: a ping each second cut a generation of a few seconds.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from gateway.epp.envoy import PICKER_DOWN
from tests.support.epp import EppProc, envoy_proc, epp_proc
from tests.support.gateway import (
    FAST_HEALTH,
    inflight,
    metric_values,
    request_statuses,
    wait_for,
)
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
# a completion of some seconds at the simulator's speed (time scale 1), answered whole
LONG = {"model": MODEL, "prompt": "x", "max_tokens": 800, "ignore_eos": True}
# one still running at the replica for some minutes (a replica's requests ending leave its
# token counters still, and the picker would end a request still held there as stalled)
LONGER = {**LONG, "max_tokens": 20_000}


def _start(procs: list[Proc], edit: Any = None, health: dict[str, Any] | None = None,
           sim_args: tuple[str, ...] = ()) -> tuple[EppProc, str]:
    sim, url = sim_proc(None, "--time-scale", "1", *sim_args, model=MODEL)
    procs.append(sim.start())
    epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}},
                           "health": {**FAST_HEALTH, **(health or {})}})
    procs.append(epp.start())
    envoy, base = envoy_proc(epp.picker, edit=edit)
    procs.append(envoy.start())
    return epp, base



def _ping_every_second(config: dict[str, Any]) -> None:
    """The picker's cluster pinging each second (a Gateway implementation's keepalive)."""
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "kvgate_epp":
            options = cluster["typed_extension_protocol_options"][
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
            options["explicit_http_config"]["http2_protocol_options"] = {
                "connection_keepalive": {"interval": "1s", "timeout": "20s"}}


def test_a_frozen_picker_is_the_failclose_503_not_a_hang(procs: list[Proc]) -> None:
    epp, base = _start(procs)
    one = {"model": MODEL, "prompt": "y", "max_tokens": 1}
    assert httpx.post(f"{base}/v1/completions", json=one, timeout=30).status_code == 200
    assert epp.popen is not None
    epp.popen.send_signal(signal.SIGSTOP)  # the connection stays open; nothing answers
    try:
        r = httpx.post(f"{base}/v1/completions", json=one, timeout=60)
    finally:
        epp.popen.send_signal(signal.SIGCONT)
    assert r.status_code == 503
    assert r.json()["error"]["message"] == PICKER_DOWN
    # resumed, it serves again (Envoy opens a new connection)
    wait_for(lambda: httpx.post(f"{base}/v1/completions", json=one, timeout=30).status_code
             == 200, timeout=30, what="the picker serving again")


def test_keepalive_pings_leave_a_long_whole_answer_alone(procs: list[Proc]) -> None:
    epp, base = _start(procs, _ping_every_second)
    r = httpx.post(f"{base}/v1/completions", json=LONG, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
    wait_for(lambda: inflight(epp.base) == 0, what="the exchange settled")


def test_a_frozen_envoy_lets_go_of_its_exchanges(procs: list[Proc]) -> None:
    # the reverse: Envoy stops answering (frozen) with a request in flight; the picker's
    # pings find it (`KEEPALIVE_MS` + its timeout: 10 s), and the exchange is ended (the
    # replica's in-flight count back to 0), where it was held for as long as the connection
    # stayed open
    epp, base = _start(procs)
    envoy = procs[-1]
    assert envoy.popen is not None
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, f"{base}/v1/completions", json=LONGER, timeout=300)
        wait_for(lambda: inflight(epp.base) == 1, timeout=30, what="the request in flight")
        envoy.popen.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: inflight(epp.base) == 0, timeout=60, what="the exchange ended")
            assert request_statuses(epp.base).get("499") == 1
        finally:
            envoy.popen.send_signal(signal.SIGCONT)
        # resumed, Envoy finds its exchange gone: the FailClose 503
        answer = sent.result()
        assert answer.status_code == 503
        assert answer.json()["error"]["message"] == PICKER_DOWN


def test_a_frozen_envoy_is_not_the_replicas_stall(procs: list[Proc]) -> None:
    # a short whole answer: the replica is done with it in a moment, its counters then still
    # while the frozen Envoy holds the answer. The replica starts on it 1.5 s after it came
    # (the simulator's latency fault), so Envoy is frozen before the answer can pass: without
    # it a loaded machine froze Envoy after the 20 tokens had gone through (a 200)
    epp, base = _start(procs, health={"stall_after_s": 4}, sim_args=("--latency-ms", "1500"))
    envoy = procs[-1]
    assert envoy.popen is not None
    short = {**LONG, "max_tokens": 20}
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, f"{base}/v1/completions", json=short, timeout=120)
        wait_for(lambda: inflight(epp.base) == 1, timeout=30, what="the request in flight")
        envoy.popen.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: inflight(epp.base) == 0, timeout=30, what="the exchange ended")
            statuses = request_statuses(epp.base)
        finally:
            envoy.popen.send_signal(signal.SIGCONT)
        assert sent.result().status_code == 503  # (its exchange ended: the FailClose 503)
    assert statuses == {"499": 1}  # the picker's pings ended it, not a stall's 504
    assert sum(metric_values(epp.base, "kvgate_replica_stalls_total").values()) == 0
    assert list(metric_values(epp.base, "kvgate_replica_healthy").values()) == [1.0]
    assert httpx.post(f"{base}/v1/completions", json=short, timeout=60).status_code == 200


def test_two_envoys_one_frozen_the_other_serves_on(procs: list[Proc]) -> None:
    # two Envoys share the picker; one frozen with a stream in flight: its exchange alone is
    # ended (its connection's pings go unanswered), the other's streams run to their end
    epp, base = _start(procs, health={"stall_after_s": 4})
    frozen = procs[-1]
    other, other_base = envoy_proc(epp.picker)
    procs.append(other.start())
    assert frozen.popen is not None
    stream = {**LONG, "max_tokens": 60, "stream": True}

    def streamed(url: str) -> bytes:
        with httpx.stream("POST", f"{url}/v1/completions", json=stream, timeout=60) as resp:
            assert resp.status_code == 200
            return resp.read()

    with ThreadPoolExecutor(3) as pool:
        held = pool.submit(httpx.post, f"{base}/v1/completions", json=LONGER, timeout=120)
        wait_for(lambda: inflight(epp.base) == 1, timeout=30, what="the request in flight")
        frozen.popen.send_signal(signal.SIGSTOP)
        try:
            served = list(pool.map(streamed, [other_base] * 2))
            wait_for(lambda: inflight(epp.base) == 0, timeout=30, what="every exchange ended")
            statuses = request_statuses(epp.base)
        finally:
            frozen.popen.send_signal(signal.SIGCONT)
        assert held.result().status_code == 503
    assert all(body.endswith(b"data: [DONE]\n\n") for body in served)
    assert statuses == {"200": 2, "499": 1}
