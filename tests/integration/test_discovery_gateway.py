"""Discovery wired into a real gateway: a fake Kubernetes API (the one test_discovery.py
serves) lists real simulated replicas; replicas join and leave while traffic flows, and a
replica that leaves finishes its in-flight stream before it is dropped. DNS mode too."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.fake_kube import (
    NAMESPACE,
    SERVICE,
    TOKEN,
    FakeKube,
    endpoint,
    eps,
)
from tests.support.gateway import GatewayProc, gateway_proc
from tests.support.procs import Proc

MODEL = "sim-model"
ROUTING = {"policy": "round_robin", "scrape_interval_ms": 100}


@pytest.fixture
def started() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


def replica_slice(name: str, url: str) -> dict[str, Any]:
    """An EndpointSlice with one ready endpoint, 127.0.0.1 on the replica's port."""
    obj = eps(name, endpoint("127.0.0.1"))
    obj["ports"][0]["port"] = int(url.rsplit(":", 1)[1])
    return obj


def rid(url: str) -> str:
    return url.removeprefix("http://")


async def start(proc: GatewayProc, started: list[Proc]) -> None:
    started.append(proc)
    await asyncio.to_thread(proc.start)  # the loop keeps serving the fake API meanwhile


async def replica_series(base: str, name: str) -> dict[str, float]:
    """replica id -> value of one per-replica metric of the gateway."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{base}/metrics")).text
    return {m[1]: float(m[2]) for m in re.finditer(
        rf'^{name}\{{pool="fp8",replica="([^"]+)"\}} (\S+)$', text, re.M)}


async def until(condition: Callable[[], Any], what: str) -> None:
    """Poll the gateway (another process: no event to await) until `condition()` holds."""
    deadline = asyncio.get_running_loop().time() + 15
    while not await condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def served_by(client: openai.AsyncOpenAI) -> str:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert raw.parse().choices[0].message.content
    return raw.headers["x-kvgate-replica"].removeprefix("fp8/")


async def test_replicas_join_and_leave_without_dropping_a_stream(
    sim_factory: Callable[..., tuple[Proc, str]], started: list[Proc],
    kube: tuple[FakeKube, str], tmp_path: Path,  # the fake API stops before the gateway
) -> None:
    fake, api = kube
    # The first replica runs 10x slower than real time, so its stream (~3 s) outlives the
    # changes (under 1 s here); the in-flight check below fails loudly if it did not.
    _, first = sim_factory("--time-scale", "0.1")
    _, second = sim_factory("--time-scale", "50")
    (tmp_path / "token").write_text(TOKEN)
    discovery = {"kubernetes": {"service": SERVICE, "namespace": NAMESPACE, "api_server": api,
                                "token_path": str(tmp_path / "token"), "ca_path": None}}
    fake.put(replica_slice("one", first), event=None)
    gw, base = gateway_proc(config={"pools": {"fp8": {"served_model": MODEL,
                                                      "discovery": discovery}},
                                    "routing": ROUTING})
    await start(gw, started)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=30)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a long story"}], max_tokens=120,
        stream=True)
    assert stream.response.headers["x-kvgate-replica"] == f"fp8/{rid(first)}"
    chunks = [c async for c in _take(stream, 2)]

    fake.put(replica_slice("two", second), event="ADDED")
    await until(lambda: _has(base, rid(second)), "the second replica discovered")
    seen = {await served_by(client) for _ in range(4)}
    assert rid(second) in seen

    fake.delete("one")
    await until(lambda: _draining(base, rid(first)), "the first replica draining")
    assert (await replica_series(base, "kvgate_inflight_requests"))[rid(first)] == 1
    assert {await served_by(client) for _ in range(4)} == {rid(second)}

    chunks += [c async for c in stream]  # the stream on the leaving replica completes
    assert chunks[-1].choices[0].finish_reason in {"stop", "length"}
    assert sum(len(c.choices[0].delta.content or "") for c in chunks if c.choices) > 0
    await until(lambda: _gone(base, rid(first)), "the drained replica dropped")


async def _take(stream: openai.AsyncStream[Any], n: int) -> AsyncIterator[Any]:
    for _ in range(n):
        yield await stream.__anext__()


async def _has(base: str, replica: str) -> bool:
    return (await replica_series(base, "kvgate_replica_healthy")).get(replica) == 1


async def _draining(base: str, replica: str) -> bool:
    return (await replica_series(base, "kvgate_replica_healthy")).get(replica) == 0


async def _gone(base: str, replica: str) -> bool:
    return replica not in await replica_series(base, "kvgate_inflight_requests")


async def test_dns_mode_resolves_localhost(
    sim_factory: Callable[..., tuple[Proc, str]], started: list[Proc],
) -> None:
    _, url = sim_factory("--time-scale", "50")
    port = int(url.rsplit(":", 1)[1])
    discovery = {"dns": {"name": "localhost", "port": port, "interval_seconds": 0.2}}
    gw, base = gateway_proc(config={"pools": {"fp8": {"served_model": MODEL,
                                                      "discovery": discovery}},
                                    "routing": ROUTING})
    await start(gw, started)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=30)
    assert await served_by(client) == f"127.0.0.1:{port}"
