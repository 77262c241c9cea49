"""A replica without engine counters (``--disable-log-stats``) that has served a stream after
a long wait for its first event (a long prefill, a queue behind work kvgate does not see: a
non-streamed request, another gateway's or client's requests) is not judged stalled when a
later stream waits as long there: the no-counter stall rule (`BlindWatch`) waits at least
twice the longest first-event wait it served.

Before: any such wait past `health.stall_after_s` with nothing streamed there was a stall:
the healthy replica ejected and its streams run again elsewhere (here, with one replica, the
stream failed). Real gateway, a simulated replica without stats, the official client; the
simulator's engine hang stands for the long wait (nothing comes, /health stays 200).
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
ENV = {"KVGATE_HEALTH__STALL_AFTER_S": "1", "KVGATE_HEALTH__EJECT_BASE_S": "30",
       "KVGATE_HEALTH__EJECT_MAX_S": "30",  # (the fast default caps it at 1 s)
       "KVGATE_ROUTING__SILENT_MIN_S": "0"}


@pytest.fixture()
def stack() -> Iterator[tuple[str, str]]:
    procs: list[Proc] = []
    try:
        blind, blind_url = sim_proc(None, "--time-scale", "20", "--disable-log-stats",
                                    model=MODEL)
        procs.append(blind.start())
        gw, base = gateway_proc(upstreams=[blind_url], env=ENV)
        procs.append(gw.start())
        yield blind_url, base
    finally:
        for p in reversed(procs):
            p.signal(signal.SIGCONT)
            p.stop()


def _hang(url: str, on: bool) -> None:
    httpx.post(f"{url}/sim/faults", json={"engine_hang": on}, timeout=5).raise_for_status()


def test_a_wait_it_served_before_is_no_stall(stack: tuple[str, str]) -> None:
    blind_url, base = stack
    blind_id = blind_url.removeprefix("http://")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    outcomes: list[str] = []

    def ask(i: int, stream: bool) -> None:
        try:
            out = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"long {i} " * 50}],
                max_tokens=4, stream=stream)
            if isinstance(out, openai.Stream):
                assert sum(1 for _ in out) > 0
            outcomes.append("ok")
        except openai.APIError as exc:
            outcomes.append(repr(exc))

    def wait_long(*streams: bool) -> None:
        """Requests wait there with nothing coming for 3 s (3 x stall_after_s), then get
        their answers."""
        _hang(blind_url, True)
        asked = [threading.Thread(target=ask, args=(i, s)) for i, s in enumerate(streams)]
        for t in asked:
            t.start()
        wait_for(lambda: held_on(base, blind_id) >= len(streams), timeout=20,
                 what="requests waiting on the replica")
        time.sleep(3)  # (the wait being served is the point: a duration, not an event)
        _hang(blind_url, False)
        for t in asked:
            t.join(timeout=30)

    # a stream waits 3 s beside a non-streamed request (which says nothing either way:
    # the rule does not judge then) and gets its first event: a wait this replica serves
    wait_long(False, True)
    assert outcomes == ["ok", "ok"], outcomes
    # the same wait again, a stream alone: as long as the one served, no stall
    wait_long(True)
    assert outcomes == ["ok"] * 3, outcomes
    stalls = metric_values(base, "kvgate_replica_stalls_total")
    assert sum(v for k, v in stalls.items() if blind_id in k) == 0, stalls
    wait_for(lambda: sum(metric_values(base, "kvgate_inflight_requests").values()) == 0,
             timeout=30, what="nothing in flight")
