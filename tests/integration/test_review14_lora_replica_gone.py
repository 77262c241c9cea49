"""A LoRA adapter listed by kvgate's `/v1/models` (the quick form) while only a replica that
discovery has since removed loaded it: the listing kept naming it, and a request for it was a
404 "does not exist" -- a model the gateway lists that no replica serves. Real gateway with
Kubernetes discovery (the fake API of test_discovery.py), simulated replicas, the openai
client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from tests.integration.test_discovery_gateway import replica_slice, start, until
from tests.support.fake_kube import NAMESPACE, SERVICE, TOKEN, FakeKube
from tests.support.gateway import gateway_proc
from tests.support.procs import Proc


@pytest.fixture
def started() -> Iterator[list[Proc]]:
    procs: list[Proc] = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


async def _listed(client: openai.AsyncOpenAI) -> set[str]:
    return {m.id async for m in client.models.list()}


async def test_an_adapter_leaves_the_listing_with_its_replica(
    sim_factory: Callable[..., tuple[Proc, str]], started: list[Proc],
    kube: tuple[FakeKube, str], tmp_path: Path,  # the fake API stops before the gateway
) -> None:
    fake, api = kube
    _, with_sql = sim_factory("--time-scale", "50", "--lora-modules", "sql=/adapters/sql",
                              model="base")
    _, plain = sim_factory("--time-scale", "50", model="base")
    (tmp_path / "token").write_text(TOKEN)
    discovery = {"kubernetes": {"service": SERVICE, "namespace": NAMESPACE, "api_server": api,
                                "token_path": str(tmp_path / "token"), "ca_path": None}}
    fake.put(replica_slice("one", with_sql), event=None)
    fake.put(replica_slice("two", plain), event=None)
    gw, base = gateway_proc(config={"pools": {"p": {"served_model": "base",
                                                    "discovery": discovery}}})
    await start(gw, started)
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=30)

    async def sql_listed() -> bool:
        return "sql" in await _listed(client)

    async def sql_gone() -> bool:
        return "sql" not in await _listed(client)

    await until(sql_listed, "the adapter listed")
    fake.delete("one")
    await until(sql_gone, "the adapter of the removed replica no longer listed")
    assert await _listed(client) == {"base"}
    reply = await client.chat.completions.create(
        model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.model == "base"
