"""The log lines an operator reads at start and at SIGTERM. At start: which file was read (and
that KVGATE_CONFIG named it), which store holds keys and limits (Redis's address, never the
URL's password), the pools and whether authentication is on: "gateway started" named the
pools only. At SIGTERM: how many requests are drained and for how long at most, then that they
finished: uvicorn's "Waiting for connections to close" was all, as for idle connections."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai
import orjson

from tests.support.gateway import AUTH_SECRET, gateway_proc, inflight, wait_for
from tests.support.procs import Proc, redis_proc

SimFactory = Callable[..., tuple[Proc, str]]
PASSWORD = "start-line-pass-Vb40"  # tests only


def _records(gw: Proc) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in gw.output(tail=None).splitlines()
            if line.startswith("{")]


def test_the_start_line_names_the_config_the_store_and_the_pools(sim_factory: SimFactory) -> None:
    _, sim = sim_factory("--time-scale", "50")
    redis, url = redis_proc()
    redis = Proc([*redis.cmd, "--requirepass", PASSWORD], ready_port=redis.ready_port)
    address = url.removeprefix("redis://").removesuffix("/0")
    config: dict[str, Any] = {"pools": {"p": {"served_model": "sim-model", "replicas": [sim]}},
                              "models": {"llama": {"default": "p"}}}
    env = {"KVGATE_SALT_SECRET": AUTH_SECRET, "KVGATE_ADMIN_TOKEN": "start-line-admin-0123",
           "KVGATE_REDIS_URL": f"redis://:{PASSWORD}@{address}/0"}
    gw, _ = gateway_proc(config=config, env=env, auth=True)
    with redis, gw:
        gw.stop()
        records = _records(gw)
        output = gw.output(tail=None)
    (started,) = [r for r in records if r["msg"] == "gateway started"]
    assert started["config"] == gw.config_path  # --config names it (gateway_proc's file)
    assert started["store"] == f"redis at {address}"
    assert started["pools"] == ["p"] and started["auth"] is True
    assert started["policy"] == "store"  # the stored policy is in force, not the file's
    assert PASSWORD not in output


def test_sigterm_says_what_it_drains_then_that_it_drained(sim_factory: SimFactory) -> None:
    # the engine takes no step until the test lifts its hang: both streams are in flight when
    # the gateway reads SIGTERM however slow the machine (a stream of 20 tokens took ~0.2 s)
    _, sim = sim_factory("--engine-hang")
    gw, base = gateway_proc(upstreams=[sim], env={"KVGATE_SERVER__SHUTDOWN_GRACE_S": "60"})
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    chunks: list[int] = []

    def stream() -> None:
        answer = client.completions.create(model="sim-model", prompt="y", max_tokens=20,
                                           stream=True)
        chunks.append(sum(1 for _ in answer))

    with gw:
        streams = [threading.Thread(target=stream) for _ in range(2)]
        for t in streams:
            t.start()
        wait_for(lambda: inflight(base) == 2, timeout=20, what="two streams in flight")
        gw.signal(signal.SIGTERM)
        wait_for(lambda: "shutting down: draining" in gw.output(tail=None), timeout=20,
                 what="the drain's first line")
        httpx.post(f"{sim}/sim/faults", json={"engine_hang": False}).raise_for_status()
        for t in streams:
            t.join(60)
        assert gw.popen is not None and gw.popen.wait(30) == 0
        msgs = [r["msg"] for r in _records(gw)]
    assert len(chunks) == 2 and all(n > 1 for n in chunks)  # both finished, not cut
    draining = [i for i, m in enumerate(msgs) if m.startswith("shutting down: draining")]
    assert [msgs[i] for i in draining] == [
        "shutting down: draining 2 requests in flight for up to 60 s (server.shutdown_grace_s)"]
    assert "drained: every request in flight finished" in msgs[draining[0]:], msgs

