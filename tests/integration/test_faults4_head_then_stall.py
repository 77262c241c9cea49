"""A replica (or a proxy in front of one) that sends a whole answer's head and then nothing
more: nothing of it reached the client, so at `upstream.idle_timeout_s` the request is tried
on another replica, and the stalled replica is charged a failure.

Before: the idle cut was the client's 504 "The replica did not answer in time (idle
timeout)." (the SDKs retry it, from the start) though another replica could answer; vLLM
sends a whole answer's head with all of it, so a body that stops is a broken replica or
network. Real gateway, a loopback server answering those bytes
(`tests/support/bad_replica.py`), a simulated replica, the official client.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest

from tests.support.bad_replica import BadReplica
from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
# a 200 whose Content-Length says 300 bytes, 7 of which come: then the connection stays open
HEAD_ONLY = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 300\r\n"
             b"\r\n" + b'{"id": ')


@pytest.fixture
def stack() -> Iterator[tuple[str, str, str]]:
    procs: list[Proc] = []
    with BadReplica(MODEL, answer=HEAD_ONLY, end="keep") as bad:
        try:
            sim, sim_url = sim_proc(None, "--time-scale", "20", model=MODEL)
            procs.append(sim.start())
            gw, base = gateway_proc(upstreams=[bad.url, sim_url], env={
                "KVGATE_ROUTING__POLICY": "round_robin", "KVGATE_ROUTING__SILENT_MIN_S": "0",
                "KVGATE_UPSTREAM__IDLE_TIMEOUT_S": "2", "KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"})
            procs.append(gw.start())
            yield bad.url.removeprefix("http://"), sim_url.removeprefix("http://"), base
        finally:
            for p in reversed(procs):
                p.stop()


def test_a_whole_answer_stopped_after_its_head_is_answered_elsewhere(
    stack: tuple[str, str, str],
) -> None:
    bad_id, sim_id, base = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    got: list[tuple[str, str] | str] = []

    def ask(i: int) -> None:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"head {i}"}], max_tokens=4)
            assert raw.parse().choices[0].message.content
            got.append((raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-route"]))
        except openai.APIError as exc:
            got.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:  # round robin: two of them go to the stalling replica first
        t.start()
    for t in threads:
        t.join(timeout=45)
    assert len(got) == 4 and all(isinstance(g, tuple) and g[0].endswith(sim_id) for g in got), got
    assert sum(1 for g in got if g[1] == "retry") >= 1, got
    retries = metric_values(base, "kvgate_upstream_retries_total")
    assert sum(v for k, v in retries.items() if 'reason="idle"' in k) >= 1, retries
    failures = metric_values(base, "kvgate_replica_failures_total")
    assert sum(v for k, v in failures.items() if bad_id in k) >= 1, failures
    wait_for(lambda: sum(metric_values(base, "kvgate_inflight_requests").values()) == 0,
             timeout=30, what="nothing in flight")
