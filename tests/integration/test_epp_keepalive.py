"""The connection between Envoy and the picker, kept alive by HTTP/2 pings (a real Envoy).

- A picker that stops answering without closing the connection (here: its process frozen;
  in production a node or a network gone) left every request waiting for the ext_proc
  `message_timeout` (1000 s): the client's own timeout ran out with no answer. The bootstrap's
  pings on the picker's cluster (`PICKER_KEEPALIVE`) find it and close the connection: the
  request gets the FailClose 503, and the picker serves again once it resumes.
- Envoy's pings reach a picker with an exchange that sends nothing for a while (a
  non-streamed generation: no message until its answer's head). gRPC's server took one ping
  every 5 minutes without data, and dropped the connection with a GOAWAY "too_many_pings"
  past that, the request with it: a ping each second cut a generation of a few seconds.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.epp.envoy import PICKER_DOWN
from tests.support.epp import EppProc, envoy_proc, epp_proc
from tests.support.gateway import inflight, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
# a completion of some seconds at the simulator's speed (time scale 1), answered whole
LONG = {"model": MODEL, "prompt": "x", "max_tokens": 800, "ignore_eos": True}


def _start(procs: list[Proc], edit: Any = None) -> tuple[EppProc, str]:
    sim, url = sim_proc(None, "--time-scale", "1", model=MODEL)
    procs.append(sim.start())
    epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}})
    procs.append(epp.start())
    envoy, base = envoy_proc(epp.picker, edit=edit)
    procs.append(envoy.start())
    return epp, base


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)  # (a frozen one would not stop)
            proc.stop()


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
