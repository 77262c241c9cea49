"""Behind Envoy, a replica leaves the pool (its EndpointSlice deleted) during a burst of 50
concurrent streams: every stream ends whole (the ones on the leaving replica finish there), no
request picked after the picker saw it leave goes to it, and nothing stays in flight.

A fake Kubernetes API (`tests/support/fake_kube.py`), two real simulators, a real
`kvgate epp`, a real Envoy, raw HTTP.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import httpx

from tests.support.epp import EppProc, envoy_proc, epp_proc
from tests.support.fake_kube import NAMESPACE, SERVICE, TOKEN, FakeKube, endpoint, eps
from tests.support.procs import Proc, sim_proc

MODEL = "sim-model"
BURST = 50


def _slice(name: str, url: str) -> dict[str, Any]:
    obj = eps(name, endpoint("127.0.0.1"))
    obj["ports"][0]["port"] = int(url.rsplit(":", 1)[1])
    return obj


async def _series(client: httpx.AsyncClient, epp: EppProc, name: str) -> dict[str, float]:
    text = (await client.get(f"{epp.base}/metrics")).text
    return {m[1]: float(m[2]) for m in re.finditer(
        rf'^{name}\{{pool="default",replica="([^"]+)"\}} (\S+)$', text, re.M)}


async def _until(check: Any, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + 30
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _stream(client: httpx.AsyncClient, base: str, i: int, opened: list[str]) -> tuple[
        str, bytes]:
    async with client.stream("POST", f"{base}/v1/chat/completions", json={
            "model": MODEL, "stream": True, "max_tokens": 40,
            "messages": [{"role": "user", "content": f"story {i}"}]}) as resp:
        assert resp.status_code == 200, await resp.aread()
        replica = resp.headers["x-kvgate-replica"].removeprefix("default/")
        opened.append(replica)
        return replica, await resp.aread()


async def test_a_replica_leaving_during_a_burst_loses_no_stream(
    kube: tuple[FakeKube, str], tmp_path: Path,
) -> None:
    fake, api = kube
    procs: list[Proc] = []
    try:
        urls = []
        for _ in range(2):  # (slow enough that the burst is still streaming at the change)
            sim, url = sim_proc(None, "--time-scale", "2", model=MODEL)
            procs.append(await asyncio.to_thread(sim.start))
            urls.append(url)
        leaving = urls[0].removeprefix("http://")
        (tmp_path / "token").write_text(TOKEN)
        fake.put(_slice("one", urls[0]), event=None)
        fake.put(_slice("two", urls[1]), event=None)
        discovery = {"kubernetes": {"service": SERVICE, "namespace": NAMESPACE,
                                    "api_server": api, "token_path": str(tmp_path / "token"),
                                    "ca_path": None}}
        epp = epp_proc(config={
            "pools": {"default": {"served_model": MODEL, "discovery": discovery}},
            "routing": {"policy": "round_robin"}, "server": {"replica_header": True}})
        procs.append(await asyncio.to_thread(epp.start))
        envoy, base = envoy_proc(epp.picker)
        procs.append(await asyncio.to_thread(envoy.start))

        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            await _until(lambda: _has_both(client, epp, urls), "both replicas discovered")
            opened: list[str] = []
            burst = [asyncio.create_task(_stream(client, base, i, opened))
                     for i in range(BURST)]
            await _until(lambda: _true(len(opened) >= BURST // 2), "half the burst streaming")
            fake.delete("one")
            await _until(lambda: _draining(client, epp, leaving), "the replica leaving")
            held = await _series(client, epp, "kvgate_inflight_requests")
            assert held.get(leaving, 0) > 0  # (the change came mid-burst: streams there)
            after = [asyncio.create_task(_stream(client, base, BURST + i, []))
                     for i in range(20)]
            done = await asyncio.gather(*burst)
            later = await asyncio.gather(*after)
            await _until(lambda: _idle(client, epp), "nothing in flight")
        for _, body in [*done, *later]:
            assert body.endswith(b"data: [DONE]\n\n"), body[-300:]
        assert leaving in {replica for replica, _ in done}
        assert leaving not in {replica for replica, _ in later}
        assert "Traceback" not in epp.output(None)
    finally:
        for proc in reversed(procs):
            await asyncio.to_thread(proc.stop)


async def _true(value: bool) -> bool:
    return value


async def _has_both(client: httpx.AsyncClient, epp: EppProc, urls: list[str]) -> bool:
    healthy = await _series(client, epp, "kvgate_replica_healthy")
    return all(healthy.get(u.removeprefix("http://")) == 1 for u in urls)


async def _draining(client: httpx.AsyncClient, epp: EppProc, replica: str) -> bool:
    return (await _series(client, epp, "kvgate_replica_healthy")).get(replica) != 1


async def _idle(client: httpx.AsyncClient, epp: EppProc) -> bool:
    return sum((await _series(client, epp, "kvgate_inflight_requests")).values()) == 0
