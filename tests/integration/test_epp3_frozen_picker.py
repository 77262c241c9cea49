"""A picker that stops answering (its process frozen, a node or network gone without closing
the connection) costs a request at most about a second behind the shipped Envoy bootstrap.

Envoy finds it by its HTTP/2 pings on the picker's cluster (`PICKER_KEEPALIVE`): at 10 s
between pings and 5 s for the answer a request waited up to 15 s (~15 s measured) for the
FailClose 503, each request after it too (Envoy connects anew: the kernel accepts on a frozen
process, and the new connection's requests wait for its first unanswered ping). The
`message_timeout` cannot bound it: the picker holds its answers for a request's body and a
stream's first token (docs/envoy.md).
"""

from __future__ import annotations

import signal

import httpx

from gateway.epp.envoy import PICKER_DOWN, PICKER_KEEPALIVE
from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
ONE = {"model": MODEL, "prompt": "y", "max_tokens": 1}


def _seconds(duration: str) -> float:
    return float(duration.removesuffix("ms")) / 1000 if duration.endswith("ms") \
        else float(duration.removesuffix("s"))


def test_the_pings_find_a_stuck_picker_within_a_second() -> None:
    # a ping's interval then its timeout: the longest a frozen picker goes unnoticed
    worst = _seconds(PICKER_KEEPALIVE["interval"]) + _seconds(PICKER_KEEPALIVE["timeout"])
    assert worst <= 1.0


def test_requests_to_a_frozen_picker_fail_over_at_once() -> None:
    procs: list[Proc] = []
    try:
        sim, url = sim_proc(None, model=MODEL)
        procs.append(sim.start())
        epp = epp_proc(config={"pools": {"p": {"served_model": MODEL, "replicas": [url]}}})
        procs.append(epp.start())
        envoy, base = envoy_proc(epp.picker)
        procs.append(envoy.start())
        assert httpx.post(f"{base}/v1/completions", json=ONE, timeout=30).status_code == 200
        assert epp.popen is not None
        epp.popen.send_signal(signal.SIGSTOP)
        try:
            # three in a row, each with a client timeout far below the old 15 s and far
            # above the pings' second (a loaded machine's slack): each is the FailClose 503
            for _ in range(3):
                r = httpx.post(f"{base}/v1/completions", json=ONE, timeout=8)
                assert r.status_code == 503
                assert r.json()["error"]["message"] == PICKER_DOWN
        finally:
            epp.popen.send_signal(signal.SIGCONT)
        wait_for(lambda: httpx.post(f"{base}/v1/completions", json=ONE, timeout=30)
                 .status_code == 200, timeout=30, what="the picker serving again")
    finally:
        for proc in reversed(procs):
            proc.stop()
