"""A frozen replica (SIGSTOP: its connections stay open, nothing answers, not /health nor
/metrics): its requests that got nothing yet go to another replica as soon as one /health
probe times out with nothing else heard from it meanwhile, not after
`health.slow_threshold` slow probes in a row (some 21 s with the defaults).

Here the slow-probe rule is put out of reach (`slow_threshold: 1000`), so only the new rule
can move them. Before: streamed and non-streamed requests alike waited on the stopped
replica until their client's 30 s timeout (kvgate's own bounds: the first-byte timeout, 5
minutes, and the total, 30). After: each is answered by the other replica, as a retry
(`x-kvgate-route: retry`, `kvgate_upstream_retries_total{reason="stall"}`), and once the
replica is resumed nothing stays counted in flight. Real gateway, two simulated replicas,
the official client.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from tests.support.frozen import held_on
from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
ENV = {"KVGATE_HEALTH__INTERVAL_S": "0.5", "KVGATE_HEALTH__TIMEOUT_S": "1",
       "KVGATE_HEALTH__SLOW_THRESHOLD": "1000", "KVGATE_HEALTH__EJECT_BASE_S": "30",
       "KVGATE_HEALTH__EJECT_MAX_S": "30",  # (the fast default caps it at 1 s)
       # every other request goes to each replica (cache_aware would send it no second)
       "KVGATE_ROUTING__POLICY": "round_robin", "KVGATE_ROUTING__SILENT_MIN_S": "0"}


@pytest.fixture
def stack() -> Iterator[tuple[Proc, str, str, str]]:
    procs: list[Proc] = []
    try:
        frozen, frozen_url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(frozen.start())
        other, other_url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(other.start())
        gw, base = gateway_proc(upstreams=[frozen_url, other_url], env=ENV)
        procs.append(gw.start())
        yield frozen, frozen_url.removeprefix("http://"), other_url.removeprefix("http://"), base
    finally:
        for p in reversed(procs):
            p.signal(signal.SIGCONT)
            p.stop()


def test_its_waiting_requests_go_elsewhere_once_a_probe_hears_nothing(
    stack: tuple[Proc, str, str, str],
) -> None:
    frozen, frozen_id, other_id, base = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    answers: list[tuple[str, str] | str] = []

    def ask(i: int, stream: bool) -> None:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"frozen {i} " * 50}],
                max_tokens=4, stream=stream)
            out = raw.parse()
            if isinstance(out, openai.Stream):
                assert sum(1 for _ in out) > 0
            answers.append((raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-route"]))
        except openai.APIError as exc:
            answers.append(repr(exc))

    frozen.signal(signal.SIGSTOP)
    asked: list[threading.Thread] = []
    try:
        while held_on(base, frozen_id) < 2 and len(asked) < 40:  # a stream and a whole one
            asked.append(threading.Thread(target=ask, args=(len(asked), len(asked) % 2 == 0)))
            asked[-1].start()
            time.sleep(0.05)
        assert held_on(base, frozen_id) >= 2
        for t in asked:
            t.join(timeout=45)
    finally:
        frozen.signal(signal.SIGCONT)
    assert len(answers) == len(asked)
    assert all(isinstance(a, tuple) and a[0].endswith(other_id) for a in answers), answers
    assert sum(1 for a in answers if a[1] == "retry") >= 2, answers
    retries = metric_values(base, "kvgate_upstream_retries_total")
    assert sum(v for k, v in retries.items() if 'reason="stall"' in k) >= 2, retries
    wait_for(lambda: sum(metric_values(base, "kvgate_inflight_requests").values()) == 0,
             timeout=30, what="nothing in flight")
