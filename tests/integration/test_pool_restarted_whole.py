"""A pool whose replicas were all restarted (a rollout, a node drained) serves its first burst
once their /health answers again: each was found down because nothing answered there, and a
restarted replica is as good as a new one. Before, each came back half-open, one trial request
at a time: a burst of streams got 503 "on trial after an ejection" while /readyz said ready.
Real simulators (killed, started again on their ports, their first tokens slow so the trials
are still waiting when the burst arrives), a real gateway, the official openai client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx
import openai

from tests.support.gateway import gateway_proc, inflight, wait_for
from tests.support.procs import Proc, sim_proc

BURST = 6


def _stream(base: str, i: int) -> str:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    try:
        stream = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"request {i} of the burst"}],
            max_tokens=4, stream=True)
        text = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
        return "ok" if text else "empty"
    except openai.APIStatusError as exc:
        return f"{exc.status_code} {exc.message}"


def test_a_burst_after_the_whole_pool_restarted_is_served(procs: list[Proc]) -> None:
    first = [sim_proc(None)[0] for _ in range(2)]
    for sim in first:
        procs.append(sim.start())
    urls = [f"http://127.0.0.1:{p}" for p in
            (int(s.cmd[s.cmd.index("--port") + 1]) for s in first)]
    config = {"pools": {"p": {"served_model": "sim-model", "replicas": urls}},
              "models": {"m": {"default": "p"}}}
    gw, base = gateway_proc(config=config)
    procs.append(gw.start())
    assert _stream(base, -1) == "ok"
    for sim in first:
        sim.kill()
    wait_for(lambda: httpx.get(f"{base}/readyz").status_code == 503, 15, "the pool found down")
    # the same addresses, each first token 1.5 s away: the trials would still be waiting
    for url in urls:
        again, _ = sim_proc(urlsplit(url).port, "--latency-ms", "1500")
        procs.append(again.start())
    wait_for(lambda: gw.output().count("replica answers /health again") >= 2, 15,
             "both replicas answering /health")
    with ThreadPoolExecutor(BURST) as pool:
        answers = list(pool.map(lambda i: _stream(base, i), range(BURST)))
    assert answers == ["ok"] * BURST, answers
    wait_for(lambda: inflight(base) == 0, 10, "nothing left in flight")
