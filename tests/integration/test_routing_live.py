"""The routing core in the live gateway: prefix affinity, spreading of identical bursts, and
the scraped replica state reaching the router (real sims, real gateway, the openai client)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from routing.config import RouterConfig
from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc, sim_proc, start_sims

MODEL = "sim-model"
REPLICAS = 4


@pytest.fixture(scope="module")
def fleet() -> Iterator[str]:
    sims: list[Proc] = []
    try:
        # every answer takes >= 200 ms so concurrent requests are truly in flight together
        _, urls = start_sims(sims, REPLICAS, "--time-scale", "20", "--latency-ms", "200",
                             model=MODEL)
        # identical replicas, and the router left to see them so: one scrape at start (the KV
        # capacity), none after, so the non-streamed answers here teach no replica its own TTFT
        # fit. Learned from the scraped prefill counters, the replica that served the first
        # test gets a fit of its own (these sims' engine prefill times are tiny beside the
        # 200 ms spent before the engine) and, on an idle fleet, rightly takes every cold
        # request: the tests here are about prefixes, learning is the last test's. With no
        # scrape, silence (`routing.silent_min_s`) is judged on answers alone, and a loaded
        # machine's first answer after 0.5 s left replicas out of a burst: off here (its own
        # tests are test_frozen_replica.py and tests/unit/routing/test_silent_replicas.py)
        gw, base = gateway_proc(upstreams=urls, args=["--policy", "cache_aware"],
                                env={"KVGATE_ROUTING__SCRAPE_INTERVAL_MS": "600000",
                                     "KVGATE_ROUTING__SILENT_MIN_S": "0"})
        with gw:
            yield base
    finally:
        for proc in sims:
            proc.stop()


def _system(n: int) -> str:
    return " ".join(f"rule {n}-{i}: answer precisely and cite the section." for i in range(60))


def _ask(client: openai.OpenAI, messages: list[ChatCompletionMessageParam]) -> tuple[str, str]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4
    )
    raw.parse()
    return raw.headers["x-kvgate-replica"], raw.headers["x-kvgate-route"]


def test_a_conversation_stays_on_the_replica_holding_its_prefix(fleet: str) -> None:
    client = openai.OpenAI(base_url=f"{fleet}/v1", api_key="unused", max_retries=0)
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": _system(1)}]
    seen = []
    for turn in range(5):
        messages.append({"role": "user", "content": f"question {turn}: what does rule {turn} say?"})
        replica, route = _ask(client, messages)
        seen.append((replica, route))
        messages.append({"role": "assistant", "content": f"rule {turn} says to be precise."})
    replicas = {r for r, _ in seen}
    assert len(replicas) == 1, seen
    assert all(route == "prefix-hit" for _, route in seen[1:]), seen


def test_different_prefixes_use_more_than_one_replica(fleet: str) -> None:
    client = openai.OpenAI(base_url=f"{fleet}/v1", api_key="unused", max_retries=0)
    replicas = {
        _ask(client, [{"role": "system", "content": _system(100 + n)},
                      {"role": "user", "content": "hi"}])[0]
        for n in range(8)
    }
    assert len(replicas) >= 2


async def test_a_burst_of_identical_requests_spreads_within_the_bound(fleet: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{fleet}/v1", api_key="unused", max_retries=0)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": _system(7)}, {"role": "user", "content": "same"}]

    async def one() -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=4
        )
        raw.parse()
        return raw.headers["x-kvgate-replica"]

    burst = 16
    counts = Counter(await asyncio.gather(*(one() for _ in range(burst))))
    await client.close()
    # bounded load: at assignment, load <= c x mean + slack (2 x 16/4 + 4 = 12 by default);
    # within it the cost model queues copies behind the first ones rather than prefill more
    cfg = RouterConfig()
    assert max(counts.values()) <= cfg.load_factor * burst / 4 + cfg.load_slack, counts
    assert len(counts) >= 2, counts


ADMIN = "routing-live-admin-token-0123456"


def test_non_streamed_traffic_teaches_each_replicas_prefill_rate() -> None:
    """The scraped prefill histograms teach the TTFT model: an AWQ replica beside an FP8 one
    (12.5x slower prefill) looks slower after 40 non-streamed requests, none streamed."""
    sims = [sim_proc(None, "--preset", preset, "--time-scale", "20", model=MODEL)
            for preset in ("h100-8b-fp8", "a100-70b-awq")]
    procs = [proc.start() for proc, _ in sims]
    try:
        gw, base = gateway_proc(upstreams=[url for _, url in sims],
                                args=["--policy", "round_robin"],
                                env={"KVGATE_ADMIN_TOKEN": ADMIN})
        with gw:
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            for i in range(40):
                client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                    {"role": "user", "content": f"request {i} " + "words " * (100 + 60 * i)}])

            def rates() -> list[float]:
                listed = httpx.get(f"{base}/admin/replicas", timeout=5,
                                   headers={"Authorization": f"Bearer {ADMIN}"})
                by_url = {r["url"]: r["prefill_tps"] for r in listed.json()["data"][0]["replicas"]}
                return [by_url[url] for _, url in sims]

            # the FP8 replica is learned > 4x faster (12.5x by the presets)
            wait_for(lambda: rates()[0] > 4 * rates()[1], timeout=5, what=f"rates {rates()}")
    finally:
        for proc in procs:
            proc.stop()
