"""A frozen replica (its process stopped: connections stay open, nothing answers, not even
/health or /metrics) takes no new request once its requests have waited past
`routing.silent_min_s` with nothing heard from it, long before health ejects it.

Before: the cost model's predicted queue there drained with time alone, so it looked idle and
cache_aware sent it 30-33 of 40 streams (distinct prompts, 20 a second, a fresh gateway)
until its slow /health probes ejected it some 20 s later -- every one hanging until the
client gave up. Here health is slowed so that it ejects nothing within the test, the replica
is stopped with SIGSTOP until a stream waits there, and none of the 60 streams sent after its
silence goes to it (before: 4-14 of them, in 6 runs of 8). Resumed, it answers the streams it
held: none is lost.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from tests.support.frozen import ask_until_two_wait, held_on
from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"


def _attempts_on(base: str, replica: str) -> float:
    values = metric_values(base, "kvgate_replica_attempts_total")
    return sum(v for k, v in values.items() if replica in k)



@contextmanager
def _stack(env: dict[str, str]) -> Iterator[tuple[Proc, str, str]]:
    procs: list[Proc] = []
    frozen: Proc | None = None
    try:
        frozen, frozen_url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(frozen.start())
        other, other_url = sim_proc(None, "--time-scale", "20", model=MODEL)
        procs.append(other.start())
        gw, base = gateway_proc(upstreams=[frozen_url, other_url], env=env)
        procs.append(gw.start())
        yield frozen, frozen_url.removeprefix("http://"), base
    finally:
        if frozen is not None:
            frozen.signal(signal.SIGCONT)
        for p in reversed(procs):
            p.stop()


@pytest.fixture
def frozen_stack() -> Iterator[tuple[Proc, str, str]]:
    # health ejects nothing within the test: the router alone keeps requests away
    with _stack({"KVGATE_HEALTH__INTERVAL_S": "30", "KVGATE_HEALTH__TIMEOUT_S": "30",
                 "KVGATE_HEALTH__FAILURE_THRESHOLD": "1000"}) as stack:
        yield stack


def test_a_frozen_replica_takes_no_request_once_silent(
    frozen_stack: tuple[Proc, str, str],
) -> None:
    frozen, frozen_id, base = frozen_stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    frozen.signal(signal.SIGSTOP)
    answered: list[bool] = []

    def stream(i: int) -> None:
        chunks = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"held {i} " * 50}],
            max_tokens=4, stream=True)
        answered.append(sum(1 for _ in chunks) > 0)

    held: list[threading.Thread] = []
    try:
        while held_on(base, frozen_id) < 1 and len(held) < 40:  # until one waits there
            held.append(threading.Thread(target=stream, args=(len(held),)))
            held[-1].start()
            wait_for(lambda: len(answered) + held_on(base, frozen_id) >= len(held),
                     what="the stream sent on")
        assert held_on(base, frozen_id) >= 1
        waiting = held_on(base, frozen_id)
        time.sleep(2.5)  # past routing.silent_min_s (0.5 s) with nothing heard from it
        sent_there = _attempts_on(base, frozen_id)
        # 60 streams, 20 a second, each decoding a while: the other replica is busy, the
        # frozen one's requests all await a first token (none decodes there)
        after: list[str] = []

        def placed(i: int) -> None:
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"after {i} " * 50}],
                    max_tokens=20, stream=True, timeout=20)
                sum(1 for _ in raw.parse())
                after.append(raw.headers["x-kvgate-replica"])
            except openai.APIError as exc:  # (a loaded machine) -- where it went is the point
                after.append(repr(exc))

        later = [threading.Thread(target=placed, args=(i,)) for i in range(60)]
        for t in later:
            t.start()
            time.sleep(0.05)
        for t in later:
            t.join(timeout=40)
        assert _attempts_on(base, frozen_id) == sent_there, after  # none sent there
        assert held_on(base, frozen_id) == waiting  # none more sent there
    finally:
        frozen.signal(signal.SIGCONT)
        for t in held:
            t.join(timeout=30)
    assert len(answered) == len(held) and all(answered)  # resumed: every held stream answered
    wait_for(lambda: sum(metric_values(base, "kvgate_inflight_requests").values()) == 0,
             what="nothing in flight")


def test_its_waiting_requests_go_elsewhere_once_health_finds_it_down() -> None:
    """Its requests that got nothing yet are cut when its health checks find it down (two
    /health probes in a row timing out, nothing answered meanwhile) and tried on the other
    replica. Before: a non-streamed one waited for `upstream.total_timeout_s` (30 minutes),
    here until its client's 20 s timeout."""
    env = {"KVGATE_HEALTH__INTERVAL_S": "0.5", "KVGATE_HEALTH__TIMEOUT_S": "0.5",
           "KVGATE_HEALTH__SLOW_THRESHOLD": "2", "KVGATE_HEALTH__EJECT_BASE_S": "30",
           "KVGATE_HEALTH__EJECT_MAX_S": "30",  # (the fast default caps it at 1 s)
           # every other request goes there (the router would send it no second: above)
           "KVGATE_ROUTING__POLICY": "round_robin", "KVGATE_ROUTING__SILENT_MIN_S": "0"}
    with _stack(env) as (frozen, frozen_id, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=20)
        frozen.signal(signal.SIGSTOP)
        sent, outcomes = ask_until_two_wait(client, base, frozen_id, MODEL, "cut")
        assert outcomes == ["ok"] * sent
        retries = metric_values(base, "kvgate_upstream_retries_total")
        assert sum(v for k, v in retries.items() if 'reason="stall"' in k) >= 2, retries
        wait_for(lambda: sum(metric_values(base, "kvgate_inflight_requests").values()) == 0,
                 what="nothing in flight")
