"""A request cut from a frozen replica is not retried on a fallback that left service after the
pick (here asleep; two replicas frozen with one host or network do it too): it goes to one that
is in service, and every counter settles once.

Before: the attempt loop tried the decision's fallbacks in the order picked, out of service or
not. The cut request went to the sleeping replica -- whose waiting requests had been cut when it
was found asleep, before this one got there -- and waited, uncut, until its client's timeout
(probed with two replicas frozen at once: some 31 s more, until the second one was found frozen
again). Real gateway, three simulated replicas, the official client.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.frozen import held_on
from tests.support.gateway import gateway_proc, inflight, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
# round robin: a request picked for the first replica has the second, then the third, as its
# fallbacks; a frozen replica is found so after one silent /health probe (slow probes: never)
CONFIG = {
    "health": {"interval_s": 0.3, "timeout_s": 1, "slow_threshold": 1000, "eject_base_s": 30},
    "routing": {"policy": "round_robin", "silent_min_s": 0},
}


@pytest.fixture
def stack() -> Iterator[tuple[list[Proc], list[str], str, Proc]]:
    procs: list[Proc] = []
    try:
        sims, urls = [], []
        for _ in range(3):
            sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
            sim.env["VLLM_SERVER_DEV_MODE"] = "1"  # its /sleep
            procs.append(sim.start())
            sims.append(sim)
            urls.append(url)
        pools = {"p": {"served_model": MODEL, "replicas": urls}}
        gw, base = gateway_proc(config={**CONFIG, "pools": pools})
        procs.append(gw.start())
        yield sims, urls, base, gw
    finally:
        for p in reversed(procs):
            p.signal(signal.SIGCONT)
            p.stop()


def _healthy(base: str, url: str) -> float:
    values = metric_values(base, "kvgate_replica_healthy")
    return sum(v for k, v in values.items() if url.removeprefix("http://") in k)


def test_a_cut_request_skips_a_fallback_out_of_service_since_its_pick(
    stack: tuple[list[Proc], list[str], str, Proc],
) -> None:
    sims, urls, base, gw = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=25)
    # round robin's order: three turns, one per replica; the fourth is the first's again,
    # with the second, then the third, as its fallbacks
    turns = [client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
    ).headers["x-kvgate-replica"].removeprefix("p/") for _ in range(3)]
    by_id = {u.removeprefix("http://"): (u, s) for u, s in zip(urls, sims, strict=True)}
    (frozen, stopped), (sleepy, _), (awake, _) = (by_id[t] for t in turns)
    answers: list[object] = []

    def ask(i: int) -> None:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"cut {i} " * 40}],
                max_tokens=4)
            raw.parse()
            answers.append((raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-route"]))
        except openai.APIError as exc:
            answers.append(repr(exc))

    stopped.signal(signal.SIGSTOP)
    asked = [threading.Thread(target=ask, args=(0,))]  # the fourth turn: `frozen`'s
    asked[0].start()
    wait_for(lambda: held_on(base, frozen.removeprefix("http://")) == 1, timeout=30,
             what="a request waiting on the frozen replica")
    assert httpx.post(f"{sleepy}/sleep", params={"level": "1"}, timeout=10).status_code == 200
    wait_for(lambda: _healthy(base, sleepy) == 0, timeout=30, what="the sleeper found asleep")
    # (the frozen one is found so only after a scrape's timeout of silence: still waiting)
    assert held_on(base, frozen.removeprefix("http://")) == 1
    asked[0].join(timeout=60)
    assert answers == [(f"p/{awake.removeprefix('http://')}", "retry")], answers
    retries = metric_values(base, "kvgate_upstream_retries_total")
    assert retries == {'{pool="p",reason="stall"}': 1.0}, retries  # one retry, once
    stopped.signal(signal.SIGCONT)
    wait_for(lambda: inflight(base) == 0, timeout=30, what="nothing in flight")
    lines = [line for line in gw.output(None).splitlines() if '"msg":"request"' in line]
    lines = [line for line in lines if '"route":"round-robin"' not in line]
    assert len(lines) == 1 and '"attempts":2' in lines[0], lines  # one line, two tries
    assert '"status":200' in lines[0] and awake.removeprefix("http://") in lines[0]
