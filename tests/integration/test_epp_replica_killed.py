"""Behind Envoy, a replica killed (SIGKILL) while it streams an answer: the client's stream
ends with an error (Envoy resets it: no hang, never read as complete), the picker's in-flight
count returns to 0, and the picker marks the replica down at once, as the HTTP edge marks down
a replica whose connection is refused.

Before: Envoy tells the picker nothing of the replica's reset, so the exchange counted as a
client that left (499) and the replica stayed up until health polling found it (every
`health.interval_s`, 2 s by default): the next request sent to it in between was Envoy's
connect failure, the client's 502 "The replica did not answer.". Now the picker asks a replica
whose answer was cut for a connection: refused (or reset as the process exits), the replica
died and is marked down.

Two real simulators (round robin), a real `kvgate epp`, a real Envoy, raw HTTP.
"""

from __future__ import annotations

import httpx

from tests.support.epp import envoy_proc, epp_proc
from tests.support.gateway import inflight, metric_values, request_statuses, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
# health polling would not find the dead replica during the test
HEALTH = {"interval_s": 60, "timeout_s": 0.5, "failure_threshold": 2}


def test_a_replica_killed_mid_stream_is_marked_down_at_once() -> None:
    procs: list[Proc] = []
    try:
        sims: dict[str, Proc] = {}
        for _ in range(2):  # (real time: a long answer streams for seconds)
            sim, url = sim_proc(None, "--time-scale", "1", model=MODEL)
            procs.append(sim.start())
            sims[url.removeprefix("http://")] = sim
        epp = epp_proc(config={
            "pools": {"default": {"served_model": MODEL,
                                  "replicas": [f"http://{u}" for u in sims]}},
            "routing": {"policy": "round_robin"}, "server": {"replica_header": True},
            "health": HEALTH})
        procs.append(epp.start())
        envoy, base = envoy_proc(epp.picker)
        procs.append(envoy.start())

        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=30, json={
                "model": MODEL, "stream": True, "max_tokens": 3000,
                "messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status_code == 200
            victim = resp.headers["x-kvgate-replica"].removeprefix("default/")
            chunks, got = resp.iter_raw(), b""
            while got.count(b"data:") < 3:
                got += next(chunks)
            sims[victim].kill()
            try:
                got += b"".join(chunks)
                ended = "whole"
            except httpx.RemoteProtocolError:  # (Envoy resets the client's stream)
                ended = "cut"
        assert ended == "cut" and b"[DONE]" not in got
        wait_for(lambda: inflight(epp.base) == 0, what="nothing in flight at the picker")
        wait_for(lambda: metric_values(epp.base, "kvgate_replica_healthy")[
            f'{{pool="default",replica="{victim}"}}'] == 0, what="the dead replica marked down")
        # the replica's failure (502) when it refused the picker's connection; a connection
        # that raced its exit (taken, then reset) marks it down after the request counted as
        # a client that left (499)
        assert set(request_statuses(epp.base)) <= {"499", "502"}

        served = []
        for _ in range(4):  # round robin: two of them went to the dead replica
            answer = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
                "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            assert answer.status_code == 200, answer.text
            served.append(answer.headers["x-kvgate-replica"].removeprefix("default/"))
        assert victim not in served
        assert "Traceback" not in epp.output(None)
    finally:
        for proc in reversed(procs):
            proc.stop()
