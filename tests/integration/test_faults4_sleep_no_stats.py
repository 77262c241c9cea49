"""A vLLM replica run with ``--disable-log-stats`` (no `vllm:engine_sleep_state` to scrape)
put to sleep over its dev-mode ``POST /sleep``: kvgate asks its ``GET /is_sleeping`` with
its health checks, takes it out while it sleeps (its requests that got nothing yet tried on
the other replica) and back once it wakes.

Before: nothing told kvgate (its /health stays 200, its /metrics has no engine series), so
the requests sent there, streamed or not, waited on the sleeping engine until their
client's 30 s timeout (kvgate's own bounds: the first-byte timeout, 5 minutes, and the
total, 30). Real gateway, two simulated replicas in dev mode, the official client.
"""

from __future__ import annotations

import threading

import httpx
import openai

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"


def _sim(procs: list[Proc]) -> str:
    proc, url = sim_proc(None, "--time-scale", "20", "--disable-log-stats", model=MODEL)
    proc.env["VLLM_SERVER_DEV_MODE"] = "1"
    procs.append(proc.start())
    return url


def _ask_all(client: openai.OpenAI, n: int, tag: str) -> list[str]:
    """`n` requests at once, streamed and not: each one's x-kvgate-replica, or its error."""
    got: list[str] = []

    def ask(i: int) -> None:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": f"{tag} {i} " * 40}],
                max_tokens=4, stream=i % 2 == 0)
            out = raw.parse()
            if isinstance(out, openai.Stream):
                assert sum(1 for _ in out) > 0
            got.append(raw.headers["x-kvgate-replica"])
        except openai.APIError as exc:
            got.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=45)
    return got


def test_a_sleeping_replica_without_stats_is_found_by_is_sleeping(procs: list[Proc]) -> None:
    sleepy, awake = _sim(procs), _sim(procs)
    gw, base = gateway_proc(upstreams=[sleepy, awake], env={
        "KVGATE_ROUTING__POLICY": "round_robin", "KVGATE_ROUTING__SILENT_MIN_S": "0"})
    procs.append(gw.start())
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    assert httpx.post(f"{sleepy}/sleep", params={"level": "1"}, timeout=10).status_code == 200
    answered = _ask_all(client, 6, "asleep")  # round robin: some sent there before it is seen
    awake_id = awake.removeprefix("http://")
    assert len(answered) == 6 and all(a.endswith(awake_id) for a in answered), answered
    assert httpx.post(f"{sleepy}/wake_up", timeout=10).status_code == 200
    sleepy_id = sleepy.removeprefix("http://")
    wait_for(lambda: any(a.endswith(sleepy_id) for a in _ask_all(client, 2, "woke")),
             timeout=30, what="the woken replica serving again")
    wait_for(lambda: sum(metric_values(base, "kvgate_inflight_requests").values()) == 0,
             timeout=30, what="nothing in flight")
