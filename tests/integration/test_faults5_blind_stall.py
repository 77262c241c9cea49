"""A hung engine on a replica started with ``--disable-log-stats``: no `vllm:*` counters to
show the stall, `/health` and `/metrics` still 200. kvgate's own evidence tells instead:
streams of its own waiting there for their first event, no non-streamed request among them,
and nothing streamed or answered by the replica for `health.stall_after_s`. It is then found
stalled, and those streams go to another replica (reason `stall`).

Before: such a replica was never judged; its streams waited for the first-byte timeout (5
minutes by default; the client's 30 s here came first). Real gateway, two simulated
replicas (the hung one without stats), the official client.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.frozen import held_on
from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
ENV = {"KVGATE_HEALTH__STALL_AFTER_S": "2", "KVGATE_HEALTH__EJECT_BASE_S": "30",
       "KVGATE_HEALTH__EJECT_MAX_S": "30",  # (the fast default caps it at 1 s)
       "KVGATE_ROUTING__POLICY": "round_robin", "KVGATE_ROUTING__SILENT_MIN_S": "0"}


@pytest.fixture(params=[(), ("--sse-keep-alive-interval", "0.2")], ids=["plain", "keep-alive"])
def stack(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, str, bool]]:
    procs: list[Proc] = []
    try:
        # (keep-alive comments come from its API server while its engine hangs: no output)
        blind, blind_url = sim_proc(None, "--time-scale", "20", "--disable-log-stats",
                                    *request.param, model=MODEL)
        procs.append(blind.start())
        other, other_url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(other.start())
        gw, base = gateway_proc(upstreams=[blind_url, other_url], env=ENV)
        procs.append(gw.start())
        yield blind_url, other_url.removeprefix("http://"), base, bool(request.param)
    finally:
        for p in reversed(procs):
            p.signal(signal.SIGCONT)
            p.stop()


def test_streams_on_a_hung_engine_without_stats_go_elsewhere(
    stack: tuple[str, str, str, bool],
) -> None:
    blind_url, other_id, base, keep_alive = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    answers: list[tuple[str, str] | str] = []

    def ask(i: int) -> None:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"blind {i} " * 50}],
                max_tokens=4, stream=True)
            out = raw.parse()
            assert sum(1 for _ in out) > 0
            answers.append((raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-route"]))
        except openai.APIError as exc:
            answers.append(repr(exc))

    httpx.post(f"{blind_url}/sim/faults", json={"engine_hang": True}, timeout=5
               ).raise_for_status()
    blind_id = blind_url.removeprefix("http://")
    asked: list[threading.Thread] = []
    while held_on(base, blind_id) < 2 and len(asked) < 40:
        asked.append(threading.Thread(target=ask, args=(len(asked),)))
        asked[-1].start()
        time.sleep(0.05)
    assert held_on(base, blind_id) >= 2
    for t in asked:
        t.join(timeout=45)
    assert len(answers) == len(asked)
    assert all(isinstance(a, tuple) for a in answers), answers
    if not keep_alive:  # (else the head, sent with the first comment, names the hung one)
        assert all(isinstance(a, tuple) and a[0].endswith(other_id) for a in answers), answers
    retries = metric_values(base, "kvgate_upstream_retries_total")
    assert sum(v for k, v in retries.items() if 'reason="stall"' in k) >= 2, retries
    assert sum(v for k, v in metric_values(base, "kvgate_replica_stalls_total").items()
               if blind_id in k) >= 1
    wait_for(lambda: sum(metric_values(base, "kvgate_inflight_requests").values()) == 0,
             timeout=30, what="nothing in flight")
