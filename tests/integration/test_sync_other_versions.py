"""Entries of another format version on the routes stream (a rolling upgrade to a kvgate
whose records this one cannot read), and malformed ones (something else writing to it): they
are dropped and counted, as before, and now also said in the log, once per version and once
for malformed entries. Only a counter said so: two versions of kvgate side by side shared no
routing state, without a word. Real processes: redis-server, the simulator, a gateway."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import orjson

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

DROPPED = "kvgate_sync_records_dropped_total"


def _xadd(port: int, *fields: str) -> None:
    subprocess.run(["redis-cli", "-p", str(port), "XADD", "kvgate:routes", "*", *fields],
                   check=True, timeout=10, capture_output=True)


def _warnings(gw: Proc) -> list[str]:
    return [doc["msg"] for line in gw.output(tail=None).splitlines() if line.startswith("{")
            and (doc := orjson.loads(line))["level"] == "warning"]


def _dropped(base: str, reason: str) -> float:
    return metric_values(base, DROPPED).get(f'{{reason="{reason}"}}', 0.0)


@contextmanager
def sharing_gateway(
    sim_factory: Callable[..., tuple[Proc, str]], redis_url: str,
) -> Iterator[tuple[Proc, str, int]]:
    """A gateway sharing its routing state over `redis_url`, the sharing on: (its process,
    its base URL, Redis's port)."""
    _, sim = sim_factory("--time-scale", "50")
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_REDIS_URL": redis_url})
    with gw:
        wait_for(lambda: not httpx.get(f"{base}/readyz", timeout=5).json()["sync"]["degraded"],
                 30, "the sharing on")
        yield gw, base, port


def test_entries_it_cannot_read_are_said_once_per_kind(
    sim_factory: Callable[..., tuple[Proc, str]], redis_url: str,
) -> None:
    with sharing_gateway(sim_factory, redis_url) as (gw, base, port):
        for n in range(3):
            _xadd(port, "v", "2", "m", f"newer-host:{n}:abcdef", "t", "1.5", "x", "future")
        for _ in range(2):
            _xadd(port, "v", "1", "m", "odd-writer", "t", "not-a-time")
        wait_for(lambda: _dropped(base, "version") == 3 and _dropped(base, "malformed") == 2,
                 30, "the entries dropped")
        said = _warnings(gw)
    versions = [m for m in said if "format version" in m]
    assert len(versions) == 1, said
    assert "'2' from newer-host:0:abcdef" in versions[0] and "reads version '1'" in versions[0]
    malformed = [m for m in said if "malformed" in m]
    assert len(malformed) == 1 and "from odd-writer" in malformed[0], said
    assert "not-a-time" not in "".join(said)
