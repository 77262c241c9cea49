"""A replica discovery removed (its pod no longer ready) while a stream of kvgate's is still
relaying its tokens, and which then freezes (SIGSTOP): a draining replica was probed only
while a request there still waited for its first token, so its frozen state was never seen
and the stream ran on until `upstream.idle_timeout_s` (20 s here) ended it with the idle
timeout's event. A draining replica is probed while any request of kvgate's is there: found
frozen, its quiet stream ends with the 504 error event "The replica stopped making progress
...". A fake Kubernetes API, a real simulated replica, a real gateway, the official client."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import openai

from tests.integration.test_discovery_gateway import (
    ROUTING,
    replica_series,
    replica_slice,
    rid,
    start,
    until,
)
from tests.support.fake_kube import NAMESPACE, SERVICE, TOKEN, FakeKube
from tests.support.gateway import FAST_HEALTH, gateway_proc
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"


async def test_a_draining_replica_that_freezes_ends_its_started_stream(
    procs: list[Proc], kube: tuple[FakeKube, str], tmp_path: Path,  # the API stops first
) -> None:
    fake, api = kube
    sim, url = sim_proc(None, "--time-scale", "0.2", model=MODEL)  # a slow decode
    await asyncio.to_thread(sim.start)
    procs.append(sim)
    (tmp_path / "token").write_text(TOKEN)
    discovery = {"kubernetes": {"service": SERVICE, "namespace": NAMESPACE, "api_server": api,
                                "token_path": str(tmp_path / "token"), "ca_path": None}}
    fake.put(replica_slice("one", url), event=None)
    gw, base = gateway_proc(config={
        "pools": {"fp8": {"served_model": MODEL, "discovery": discovery}}, "routing": ROUTING,
        "health": FAST_HEALTH, "upstream": {"idle_timeout_s": 20}})
    await start(gw, procs)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=60)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=2000,
        stream=True, extra_body={"ignore_eos": True})
    chunks = 0
    error = ""
    try:
        async for _ in stream:
            chunks += 1
            if chunks == 3:
                fake.delete("one")  # its pod no longer ready: it drains, the stream goes on

                async def draining() -> bool:
                    healthy = await replica_series(base, "kvgate_replica_healthy")
                    return healthy.get(rid(url)) == 0

                await until(draining, "the replica draining")
                sim.signal(signal.SIGSTOP)  # then it freezes
    except openai.APIError as exc:
        error = str(exc)
    assert chunks >= 3 and "stopped making progress" in error, error
