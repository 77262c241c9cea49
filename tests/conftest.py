"""Shared fixtures: real processes on loopback, started per test (or module) and stopped after."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.support.procs import Proc, redis_proc, sim_proc


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
def redis_url() -> Iterator[str]:
    """A fresh redis-server for one test."""
    proc, url = redis_proc()
    with proc:
        yield url
