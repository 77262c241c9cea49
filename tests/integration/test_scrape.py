"""The metrics Scraper against real `kvgate sim` replicas (both metric dialects) and a replica
whose /metrics hangs (a local asyncio server that accepts and never answers)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Callable

import aiohttp
import openai
import pytest

from gateway.scrape import Sample, Scraper
from tests.support.procs import Proc


class Recorder:
    """Collects on_sample calls; lets a test await a condition instead of sleeping."""

    def __init__(self) -> None:
        self.samples: dict[str, list[Sample | None]] = defaultdict(list)
        self._changed = asyncio.Event()

    def __call__(self, replica: str, sample: Sample | None, now: float) -> None:
        self.samples[replica].append(sample)
        self._changed.set()

    async def until(self, cond: Callable[[], bool], within_s: float = 15.0) -> None:
        async with asyncio.timeout(within_s):
            while not cond():
                self._changed.clear()
                await self._changed.wait()

    def ok(self, replica: str) -> list[Sample]:
        return [s for s in self.samples[replica] if s is not None]


@pytest.fixture
async def hanging_url() -> AsyncIterator[str]:
    held: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # read the request, then say nothing until the test ends

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    for w in held:
        w.close()
    server.close()
    await server.wait_closed()


async def test_both_dialects_and_live_counters(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, current = sim_factory("--num-gpu-blocks", "4000", "--block-size", "16", "--time-scale", "50")
    _, legacy = sim_factory("--num-gpu-blocks", "3000", "--block-size", "16",
                            "--metrics-compat", "legacy")
    rec = Recorder()
    async with aiohttp.ClientSession() as client:
        scraper = Scraper(client, rec, interval_s=0.05, timeout_s=2.0)
        scraper.add_target("cur", current)
        scraper.add_target("old", legacy)
        async with scraper:
            await rec.until(lambda: bool(rec.ok("cur")) and bool(rec.ok("old")))
            cur, old = rec.ok("cur")[-1], rec.ok("old")[-1]
            assert (cur.legacy_names, old.legacy_names) == (False, True)
            assert cur.cache_capacity_tokens == 4000 * 16
            assert old.cache_capacity_tokens == 3000 * 16
            assert old.kv_usage is not None and old.prefix_cache_queries is not None
            assert scraper.scrape_age("cur") is not None

            api = openai.AsyncOpenAI(base_url=f"{current}/v1", api_key="unused")
            await api.completions.create(model="sim-model", prompt="hello " * 200, max_tokens=2)
            await api.close()
            await rec.until(lambda: (rec.ok("cur")[-1].prompt_tokens or 0) > 0)
            assert (rec.ok("cur")[-1].prefix_cache_queries or 0) > 0


async def test_hanging_metrics_does_not_block_others(
    sim_factory: Callable[..., tuple[Proc, str]], hanging_url: str
) -> None:
    _, sim = sim_factory()
    rec = Recorder()
    async with aiohttp.ClientSession() as client:
        scraper = Scraper(client, rec, interval_s=0.05, timeout_s=0.5)
        scraper.add_target("hang", hanging_url)
        scraper.add_target("sim", sim)
        async with scraper:
            # many good scrapes of the healthy replica while one scrape of the other hangs
            await rec.until(lambda: len(rec.ok("sim")) >= 5)
            await rec.until(lambda: len(rec.samples["hang"]) >= 1)
        assert rec.ok("hang") == []
        assert scraper.errors("hang") >= 1
        assert scraper.scrape_age("hang") is None
        assert scraper.errors("sim") == 0


async def test_targets_change_at_runtime(sim_factory: Callable[..., tuple[Proc, str]]) -> None:
    proc_a, a = sim_factory()
    _, b = sim_factory()
    rec = Recorder()
    async with aiohttp.ClientSession() as client:
        scraper = Scraper(client, rec, interval_s=0.05, timeout_s=1.0)
        scraper.add_target("a", a)
        async with scraper:
            await rec.until(lambda: len(rec.ok("a")) >= 1)
            scraper.add_target("b", b)  # added while running
            await rec.until(lambda: len(rec.ok("b")) >= 1)
            scraper.remove_target("a")
            seen_a = len(rec.samples["a"])
            await rec.until(lambda: len(rec.ok("b")) >= 6)
            assert len(rec.samples["a"]) == seen_a  # removal cancels its in-flight scrape
            assert sorted(scraper.targets()) == ["b"]
            scraper.add_target("a", a)
            proc_a.stop()  # a dead replica reports None, not an exception
            await rec.until(lambda: rec.samples["a"][-1:] == [None])


async def test_data_parallel_capacity_and_no_load_data(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    # 2 data-parallel engines of 3,000 blocks each: vLLM exports a cache_config_info series per
    # engine, each carrying the 6,000-block total, and a per-engine kv_cache_size_tokens
    _, dp2 = sim_factory("--data-parallel-size", "2", "--num-gpu-blocks", "3000",
                         "--block-size", "16")
    _, quiet = sim_factory("--disable-log-stats")
    rec = Recorder()
    async with aiohttp.ClientSession() as client:
        scraper = Scraper(client, rec, interval_s=0.05, timeout_s=2.0)
        scraper.add_target("dp2", dp2)
        scraper.add_target("quiet", quiet)
        async with scraper:
            await rec.until(lambda: bool(rec.ok("dp2")) and len(rec.samples["quiet"]) >= 2)
        assert rec.ok("dp2")[-1].cache_capacity_tokens == 2 * 3000 * 16  # not 4 x 3,000 x 16
        # --disable-log-stats: no vllm:* series is "no load data", never a sample of Nones
        assert rec.ok("quiet") == []
        assert scraper.no_load_data("quiet") and not scraper.no_load_data("dp2")
        assert scraper.scrape_age("quiet") is None


GOOD_PAGE = (b'vllm:num_requests_running{engine="0"} 3\n'
             b'vllm:cache_config_info{block_size="16",num_gpu_blocks="100",engine="0"} 1\n')
GARBAGE_PAGES = [
    GOOD_PAGE.replace(b'"100"', b'"inf"'),  # int(float("inf")) is an OverflowError
    b"vllm:\xff\xfe not a page at all {{{\n",
    GOOD_PAGE.replace(b" 3\n", b" 1e999999\n"),
]


@pytest.fixture
async def page_url() -> AsyncIterator[tuple[list[bytes], str]]:
    """A /metrics that serves ``pages[0]`` (the test changes it)."""
    pages = [GOOD_PAGE]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                await reader.readuntil(b"\r\n\r\n")
                body = pages[0]
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield pages, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("garbage", GARBAGE_PAGES, ids=["inf-label", "binary", "huge-value"])
async def test_a_garbage_page_is_a_failed_scrape_and_polling_goes_on(
    page_url: tuple[list[bytes], str], garbage: bytes,
) -> None:
    """Whatever a page holds, a scrape fails or succeeds: the target's polling task must not
    die on it (the replica would never be scraped again, its load left to age out)."""
    pages, url = page_url
    rec = Recorder()
    async with aiohttp.ClientSession() as client:
        scraper = Scraper(client, rec, interval_s=0.02, timeout_s=2.0)
        scraper.add_target("r", url)
        async with scraper:
            await rec.until(lambda: len(rec.ok("r")) >= 1)
            pages[0] = garbage
            seen = len(rec.samples["r"])
            await rec.until(lambda: len(rec.samples["r"]) >= seen + 2)  # the garbage scraped
            pages[0] = GOOD_PAGE
            await rec.until(lambda: (rec.samples["r"][-1] or Sample()).running == 3)
