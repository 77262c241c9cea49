"""A request on its last try (no other replica to try: `upstream.max_attempts` 1 here, or the
retry budget spent) is not cut when its replica is ejected for other requests' failures: that
replica may still answer it, and a cut has nowhere to send it.

Before: every ejection cut the replica's requests that had nothing back yet, the last try's
too, and the client got the 504 "The replica stopped making progress ..." while the replica was
serving it (the picker's edge had been spared this at an ejection for failures; a stalled,
down, frozen or asleep replica still ends such a request at once). Real gateway, two simulated
replicas, the official client.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.frozen import held_on
from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
CONFIG = {
    "health": {"interval_s": 0.3, "timeout_s": 1, "failure_threshold": 2, "eject_base_s": 30},
    "routing": {"policy": "round_robin", "silent_min_s": 0},
    "upstream": {"max_attempts": 1},
}


@pytest.fixture
def stack() -> Iterator[tuple[str, str, str]]:
    procs: list[Proc] = []
    try:
        urls = []
        for _ in range(2):
            sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
            procs.append(sim.start())
            urls.append(url)
        pools = {"p": {"served_model": MODEL, "replicas": urls}}
        gw, base = gateway_proc(config={**CONFIG, "pools": pools})
        procs.append(gw.start())
        yield urls[0], urls[1], base
    finally:
        for p in reversed(procs):
            p.stop()


def _healthy(base: str, url: str) -> float:
    values = metric_values(base, "kvgate_replica_healthy")
    return sum(v for k, v in values.items() if url.removeprefix("http://") in k)


def test_an_ejection_for_failures_leaves_a_last_try_to_its_replica(
    stack: tuple[str, str, str],
) -> None:
    failing, _, base = stack
    failing_id = failing.removeprefix("http://")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    answers: list[object] = []

    def ask(i: int) -> None:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"wait {i}"}], max_tokens=4)
            raw.parse()
            answers.append(raw.headers["x-kvgate-replica"])
        except openai.APIStatusError as exc:
            answers.append(exc.status_code)

    # a request waits there (its engine starts it 3 s late): round robin sends every other one
    httpx.post(f"{failing}/sim/faults", json={"latency_ms": 3000}).raise_for_status()
    asked: list[threading.Thread] = []
    while held_on(base, failing_id) < 1 and len(asked) < 10:
        asked.append(threading.Thread(target=ask, args=(len(asked),)))
        asked[-1].start()
        wait_for(lambda: len(answers) + inflight(base) >= len(asked), what="sent on")
    assert held_on(base, failing_id) == 1
    # ... while the next ones there fail at once: it is ejected (2 failures in a row)
    httpx.post(f"{failing}/sim/faults",
               json={"latency_ms": 0, "error_rate": 1.0}).raise_for_status()
    for _ in range(10):
        if _healthy(base, failing_id) == 0:
            break
        with contextlib.suppress(openai.APIStatusError):  # (its 500, relayed: no other try)
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "fail"}], max_tokens=2)
    assert _healthy(base, failing_id) == 0
    for t in asked:
        t.join(timeout=30)
    # the waiting one was answered by its replica, not cut into a 504
    assert f"p/{failing_id}" in answers and 504 not in answers, answers
    assert not metric_values(base, "kvgate_upstream_retries_total")
    wait_for(lambda: inflight(base) == 0, timeout=30, what="nothing in flight")
