"""Shared fixtures: real processes on loopback, started per test (or module) and stopped after."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from aiohttp import web

from tests.support.fake_kube import COLLECTION, FakeKube
from tests.support.procs import Proc, free_port, port_slice, redis_proc, sim_proc

# under pytest-xdist (`pytest -n 2`): each worker picks free ports from its own range
port_slice(os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT"))


@pytest.fixture
def sim_factory() -> Iterator[Callable[..., tuple[Proc, str]]]:
    """Start simulated replicas: ``proc, url = sim_factory("--time-scale", "50")``."""
    started: list[Proc] = []

    def start(*args: str, model: str = "sim-model") -> tuple[Proc, str]:
        proc, url = sim_proc(None, *args, model=model)
        started.append(proc.start())
        return proc, url

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Processes a test starts and appends (``procs.append(proc.start())``), stopped last
    first at its end -- a stopped (SIGSTOP) one is resumed first, or it would not stop."""
    started: list[Proc] = []
    try:
        yield started
    finally:
        for proc in reversed(started):
            if proc.popen is not None and proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)
            proc.stop()


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A fresh redis-server for one test."""
    proc, url = redis_proc()
    with proc:
        yield url


@pytest.fixture
async def kube() -> AsyncIterator[tuple[FakeKube, str]]:
    """A fake Kubernetes API (EndpointSlice list + watch) on a free loopback port."""
    fake = FakeKube()
    app = web.Application()
    app.router.add_get(COLLECTION, fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield fake, f"http://127.0.0.1:{port}"
    fake.close_streams()
    await runner.cleanup()
