"""A replica whose engine hung mid-stream comes back once it recovers, though requests it hung
before its ejection are still open (gray failures, scenario 3: `loadtest.gray_failures`).

A hung engine holds its requests until their clients leave: a non-streamed one has no
idle timeout in kvgate (the total one only), and the openai SDK waits 10 minutes. Counting
those as the half-open replica's trial kept it out of rotation that long after it recovered;
here the pool's only replica answered 503 until then."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]


def _hold(base: str, done: list[int]) -> None:
    """A non-streamed request the hung engine holds; its client leaves after 9 s."""
    body = {"model": MODEL, "prompt": "held", "max_tokens": 64}
    try:
        done.append(httpx.post(f"{base}/v1/completions", json=body, timeout=9).status_code)
    except httpx.TimeoutException:
        done.append(0)


def _stream_until_cut(base: str, i: int) -> None:
    body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 64, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert "error" in text  # cut at the idle timeout: an error event, then [DONE]


def test_a_recovered_replica_is_back_while_its_hung_requests_are_open(
    sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim], env={
        "KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "1", "KVGATE_HEALTH__EJECT_BASE_S": "2",
        "KVGATE_HEALTH__EJECT_MAX_S": "2"})
    rid = sim.removeprefix("http://")
    with gw:
        httpx.post(f"{sim}/sim/faults", json={"hang_after_tokens": 2}).raise_for_status()
        done: list[int] = []
        held = threading.Thread(target=_hold, args=(base, done))
        held.start()
        wait_for(lambda: inflight(base) == 1, what="the held request in flight")
        key = f'{{pool="default",replica="{rid}"}}'

        def ejected() -> bool:
            return metric_values(base, "kvgate_replica_healthy")[key] == 0.0

        for i in range(4):  # stalls in a row eject it (for 2 s)
            _stream_until_cut(base, i)
            time.sleep(0.1)  # (judged once the cut stream has ended)
            if ejected():
                break
        assert ejected()
        httpx.post(f"{sim}/sim/faults", json={"hang_after_tokens": -1}).raise_for_status()
        lifted = time.monotonic()
        body = {"model": MODEL, "prompt": "after", "max_tokens": 8}

        def answered() -> bool:
            return httpx.post(f"{base}/v1/completions", json=body, timeout=5).status_code == 200

        wait_for(answered, timeout=6, what="a request answered after the fault was lifted")
        assert time.monotonic() - lifted < 6 and not done  # the held request still open
        held.join(15)
        assert done == [0]  # its client gave up; kvgate let it go
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
