"""A replica discovery removed (its pod no longer ready) while a request waits there for its
answer to start, and whose process then freezes (a hung node, a black-holed network): a
replica that left its pool was no longer health-checked, so its waiting request was not cut
and tried elsewhere, as it is in a pool (`Replica.mark_down`): it waited for its first-byte
timeout (5 minutes by default; the client here gives up after 30 s). A replica that drains is
checked while requests wait there. A fake Kubernetes API, real simulated replicas, a real
gateway, the official openai client."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

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
from tests.support.gateway import gateway_proc
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"


async def test_a_draining_replica_found_frozen_has_its_waiting_request_tried_elsewhere(
    procs: list[Proc], kube: tuple[FakeKube, str], tmp_path: Path,  # the API stops first
) -> None:
    fake, api = kube
    # the request waits 10 s on `slow` before its engine takes it: frozen meanwhile
    slow, slow_url = sim_proc(None, "--time-scale", "50", "--latency-ms", "10000", model=MODEL)
    fast, fast_url = sim_proc(None, "--time-scale", "50", model=MODEL)
    for proc in (slow, fast):
        await asyncio.to_thread(proc.start)
        procs.append(proc)
    (tmp_path / "token").write_text(TOKEN)
    discovery = {"kubernetes": {"service": SERVICE, "namespace": NAMESPACE, "api_server": api,
                                "token_path": str(tmp_path / "token"), "ca_path": None}}
    fake.put(replica_slice("one", slow_url), event=None)
    fake.put(replica_slice("two", fast_url), event=None)
    gw, base = gateway_proc(config={
        "pools": {"fp8": {"served_model": MODEL, "discovery": discovery}}, "routing": ROUTING,
        "upstream": {"first_byte_timeout_s": 120}})
    await start(gw, procs)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=30)

    async def ask() -> Any:
        return await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)

    held = None
    for _ in range(4):  # round robin: one of the first two lands on the slow replica
        task = asyncio.create_task(ask())
        await asyncio.sleep(0.5)
        if (await replica_series(base, "kvgate_inflight_requests")).get(rid(slow_url)) == 1:
            held = task
            break
        await task
    assert held is not None, "no request held by the slow replica"

    fake.delete("one")  # its pod no longer ready: it drains, its request still waiting
    await until(lambda: _draining(base, rid(slow_url)), "the slow replica draining")
    slow.signal(signal.SIGSTOP)  # and it freezes

    raw = await held
    assert raw.headers["x-kvgate-replica"] == f"fp8/{rid(fast_url)}"
    assert raw.parse().choices[0].message.content


async def _draining(base: str, replica: str) -> bool:
    return (await replica_series(base, "kvgate_replica_healthy")).get(replica) == 0
