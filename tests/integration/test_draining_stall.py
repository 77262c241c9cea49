"""A replica discovery removed (its pod no longer ready) while a request is still on it, and
whose engine then hangs (sockets open, /health and /metrics 200, no token): a draining
replica was no longer scraped, so its stall was never seen and the request waited for its
first-byte timeout (120 s here; the client gives up after 30 s). A draining replica is scraped
until it is reaped: its stall is found and the request tried elsewhere. A fake Kubernetes API,
real simulated replicas, a real gateway, the official openai client."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
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


async def test_a_draining_replica_whose_engine_hangs_has_its_request_tried_elsewhere(
    procs: list[Proc], kube: tuple[FakeKube, str], tmp_path: Path,  # the API stops first
) -> None:
    fake, api = kube
    hung, hung_url = sim_proc(None, model=MODEL)  # real time: the answer takes a while
    good, good_url = sim_proc(None, "--time-scale", "50", model=MODEL)
    for proc in (hung, good):
        await asyncio.to_thread(proc.start)
        procs.append(proc)
    (tmp_path / "token").write_text(TOKEN)
    discovery = {"kubernetes": {"service": SERVICE, "namespace": NAMESPACE, "api_server": api,
                                "token_path": str(tmp_path / "token"), "ca_path": None}}
    fake.put(replica_slice("one", hung_url), event=None)
    fake.put(replica_slice("two", good_url), event=None)
    gw, base = gateway_proc(config={
        "pools": {"fp8": {"served_model": MODEL, "discovery": discovery}}, "routing": ROUTING,
        "health": {**FAST_HEALTH, "stall_after_s": 2},
        "upstream": {"first_byte_timeout_s": 120}})
    await start(gw, procs)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=30)

    async def ask() -> Any:  # whole, not streamed: nothing back until the end
        return await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=2000,
            extra_body={"ignore_eos": True})

    held = None
    for _ in range(4):  # round robin: one of the first two lands on `hung` (the slow one)
        task = asyncio.create_task(ask())
        await asyncio.sleep(0.5)
        if (await replica_series(base, "kvgate_inflight_requests")).get(rid(hung_url)) == 1:
            held = task
            break
        await task
    assert held is not None, "no request held by the replica"
    fake.delete("one")  # its pod no longer ready: it drains, the request still there

    async def draining() -> bool:
        return (await replica_series(base, "kvgate_replica_healthy")).get(rid(hung_url)) == 0

    await until(draining, "the replica draining")
    async with httpx.AsyncClient() as sim:  # and its engine hangs
        (await sim.post(f"{hung_url}/sim/faults", json={"engine_hang": True})).raise_for_status()

    raw = await held
    assert raw.headers["x-kvgate-replica"] == f"fp8/{rid(good_url)}"
    assert raw.parse().choices[0].message.content
    assert gw.output(None).count("replica stalled: requests running") == 1
