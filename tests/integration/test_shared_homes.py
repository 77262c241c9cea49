"""`SharedHomes` against a real redis-server: ids under the deployment's namespace only, a bad
value is "unknown", a Redis that never answers a failed lookup (`ResponseLookupFailed`, not
"unknown": the id may exist) within the timeout, writes past the cap are dropped and
counted."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from gateway.errors import ResponseLookupFailed
from gateway.responses import ResponseHome, ResponseStore, SharedHomes
from gateway.tenancy import connect_redis
from tests.support.procs import free_port, redis_proc

HOME = ResponseHome("acme", "p", "10.0.0.1:8000")


async def test_ids_are_shared_within_a_namespace_only(redis_url: str) -> None:
    a = SharedHomes(connect_redis(redis_url), "team-a")
    b = SharedHomes(connect_redis(redis_url), "team-b")
    task = a.put("resp_1", HOME)
    assert task is not None
    await task
    assert await a.get("resp_1") == HOME
    assert await b.get("resp_1") is None  # another deployment on the same Redis
    store = ResponseStore()
    store.shared = a
    await store.fetch("resp_1")
    assert store.home("resp_1", "acme") == HOME
    assert store.home("resp_1", "other-tenant") is None and store.foreign("resp_1", "other")
    await a.close()
    await b.close()


async def test_a_bad_value_or_an_id_of_another_shape_is_unknown(redis_url: str) -> None:
    shared = SharedHomes(connect_redis(redis_url), "ns")
    raw = connect_redis(redis_url)
    await raw.set("ns:response:resp_bad", b'{"not": "a list"}')
    await raw.set("ns:response:resp_short", b'["only-one"]')
    assert await shared.get("resp_bad") is None
    assert await shared.get("resp_short") is None
    store = ResponseStore()
    store.shared = shared
    await store.fetch("../../etc" + "x" * 300)  # not an id: never a Redis key
    assert len(store) == 0
    assert shared.errors == 2
    await raw.aclose()
    await shared.close()


async def test_a_redis_that_never_answers_costs_the_timeout_only() -> None:
    port = free_port()
    accepted: list[asyncio.StreamWriter] = []

    async def silent(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(w)  # reads nothing, answers nothing

    server = await asyncio.start_server(silent, "127.0.0.1", port)
    shared = SharedHomes(connect_redis(f"redis://127.0.0.1:{port}/0", timeout_s=5.0), "ns",
                         timeout_s=0.2)
    started = time.monotonic()
    with pytest.raises(ResponseLookupFailed):
        await shared.get("resp_1")
    assert time.monotonic() - started < 1.0
    tasks = [shared.put(f"resp_{i}", HOME) for i in range(SharedHomes.MAX_PENDING + 5)]
    assert tasks.count(None) == 5  # past the cap: dropped, not queued without end
    await shared.close()
    for w in accepted:
        w.close()
    server.close()
    await server.wait_closed()


async def test_an_outage_is_one_warning_and_its_end_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis stopped: failed writes and reads are one warning for the outage (not one a
    request); Redis back: one info line (nothing said that ids were shared again)."""
    port = free_port()
    first, url = redis_proc(port)
    first.start()
    shared = SharedHomes(connect_redis(url), "ns", timeout_s=0.2)
    with caplog.at_level(logging.INFO, logger="gateway.responses"):
        first.stop()
        for i in range(3):
            task = shared.put(f"resp_{i}", HOME)
            assert task is not None
            await task
        with pytest.raises(ResponseLookupFailed):
            await shared.get("resp_0")
        with redis_proc(port)[0]:  # back, on the same address
            task = shared.put("resp_9", HOME)
            assert task is not None
            await task
            assert await shared.get("resp_9") == HOME
            await shared.close()
    said = [r.getMessage() for r in caplog.records if r.name == "gateway.responses"]
    assert [m.split(":")[0] for m in said] == ["Responses API ids not shared through Redis",
                                               "Responses API ids shared through Redis again"]
