"""Behind Envoy, a request waiting on a replica that stops making progress ends when the picker
finds it so, as at the HTTP edge: a hung engine (`engine_hang`: its sockets open, /health and
/metrics 200, its token counters frozen; `health.stall_after_s`) or a stopped process (SIGSTOP:
its /health probes time out, `health.slow_threshold`). The picker ends the requests there that
got nothing yet with the HTTP edge's last-try 504 "The replica stopped making progress ..."
(the SDK retries it, and the next pick avoids the ejected replica).

Before: the picker registered no cut; such a request waited for Envoy's per-try idle timeout
(a stream: `upstream.first_byte_timeout_s`, 300 s) or its total one (a non-streamed answer:
30 minutes) -- here until its client's timeout. Real simulators, a real `kvgate epp`, a real
Envoy, the official openai client.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai

from tests.support.epp import EppProc, envoy_proc, epp_proc
from tests.support.gateway import FAST_HEALTH, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
CLIENT_TIMEOUT_S = 30.0  # far below Envoy's 300 s / 1800 s


@contextmanager
def _stack(health: dict[str, Any]) -> Iterator[tuple[Proc, str, EppProc, str]]:
    """(the faulty sim, its URL, the picker, Envoy's base URL): two sims, round robin."""
    procs: list[Proc] = []
    bad: Proc | None = None
    try:
        bad, bad_url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(bad.start())
        good, good_url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(good.start())
        epp = epp_proc(config={
            "pools": {"default": {"served_model": MODEL, "replicas": [bad_url, good_url]}},
            "routing": {"policy": "round_robin", "silent_min_s": 0},
            "health": {**FAST_HEALTH, **health}})
        procs.append(epp.start())
        envoy, base = envoy_proc(epp.picker)
        procs.append(envoy.start())
        yield bad, bad_url, epp, base
    finally:
        if bad is not None:
            bad.signal(signal.SIGCONT)
        for p in reversed(procs):
            p.stop()


def _inflight(epp: EppProc) -> float:
    return sum(metric_values(epp.base, "kvgate_inflight_requests").values())


def _held_on(epp: EppProc, url: str) -> float:
    values = metric_values(epp.base, "kvgate_inflight_requests")
    return sum(v for k, v in values.items() if url.removeprefix("http://") in k)


def _ask_until_held(
    client: openai.OpenAI, epp: EppProc, bad_url: str, outcomes: list[object],
) -> list[threading.Thread]:
    """Requests, streamed and not, until two wait on the faulty replica."""

    def ask(i: int, stream: bool) -> None:
        try:
            out = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"cut {i} " * 20}],
                max_tokens=4, stream=stream)
            if stream:
                assert isinstance(out, openai.Stream)
                assert sum(1 for _ in out) > 0
            outcomes.append("ok")
        except openai.APIError as exc:
            outcomes.append(exc)

    asked: list[threading.Thread] = []
    while _held_on(epp, bad_url) < 2 and len(asked) < 40:
        n = len(asked)  # (round robin: streamed and not, to both replicas)
        asked.append(threading.Thread(target=ask, args=(n, n // 2 % 2 == 1)))
        asked[-1].start()
        wait_for(lambda: len(outcomes) + _inflight(epp) >= len(asked),
                 what="the request sent on")
    assert _held_on(epp, bad_url) >= 2, "no request waits on the faulty replica"
    return asked


def _settled(epp: EppProc) -> None:
    wait_for(lambda: _inflight(epp) == 0, what="nothing in flight at the picker")
    assert "Traceback" not in epp.output(None)


def _stopped_making_progress(exc: object) -> bool:
    if not isinstance(exc, openai.APIStatusError) or exc.status_code != 504:
        return False
    error = exc.response.json()["error"]
    return (error["type"] == "GatewayTimeoutError"
            and "stopped making progress" in error["message"])


def test_a_request_on_a_hung_engine_ends_with_the_stall_504() -> None:
    """No SDK retry: the requests that went to the hung replica are the 504 at once (both a
    stream's and a whole answer's), the others answered."""
    with _stack({"stall_after_s": 2}) as (_, bad_url, epp, base):
        httpx.post(f"{bad_url}/sim/faults", json={"engine_hang": True}).raise_for_status()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                               timeout=CLIENT_TIMEOUT_S)
        outcomes: list[object] = []
        for t in _ask_until_held(client, epp, bad_url, outcomes):
            t.join(timeout=CLIENT_TIMEOUT_S + 10)
        cut = [o for o in outcomes if o != "ok"]
        assert len(cut) >= 2 and all(_stopped_making_progress(o) for o in cut), outcomes
        stalls = metric_values(epp.base, "kvgate_replica_stalls_total")
        assert sum(v for k, v in stalls.items() if bad_url.removeprefix("http://") in k) >= 1
        _settled(epp)


def test_a_request_on_a_stopped_replica_is_answered_once_health_finds_it_down() -> None:
    """The SDK's own retries (its default 2): every request is answered, those that waited
    on the stopped replica after its 504, by the other replica; no client timed out (before:
    they did, and the SDK's retry after its timeout got the answer)."""
    health = {"interval_s": 1, "timeout_s": 1, "slow_threshold": 2, "eject_base_s": 30,
              "eject_max_s": 30, "failure_threshold": 1000}
    with _stack(health) as (bad, bad_url, epp, base):
        bad.signal(signal.SIGSTOP)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=2,
                               timeout=CLIENT_TIMEOUT_S)
        outcomes: list[object] = []
        asked = _ask_until_held(client, epp, bad_url, outcomes)
        for t in asked:
            t.join(timeout=3 * CLIENT_TIMEOUT_S)
        assert outcomes == ["ok"] * len(asked)
        requests = metric_values(epp.base, "kvgate_requests_total")
        cut = sum(v for k, v in requests.items()
                  if 'status="504"' in k and bad_url.removeprefix("http://") in k)
        assert cut >= 2, requests
        assert not any('status="499"' in k for k in requests), requests  # no client gave up
        _settled(epp)
