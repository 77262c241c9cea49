"""SIGHUP (a closed terminal, `kill -HUP`, a reload an operator expected) is logged and
ignored: kvgate has no configuration reload. It killed the gateway at once (its default
action: uvicorn handles SIGTERM and SIGINT only), cutting every stream in flight without an
error event and skipping the drain; with ``--workers`` the supervisor died, and its workers
stopped after it. A real gateway, a simulated replica, the official openai client."""

from __future__ import annotations

import signal
from collections.abc import Callable

import httpx
import openai

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
MODEL = "sim-model"


def _hup_mid_stream(gw: Proc, base: str) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=400, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices  # the stream is running
    gw.signal(signal.SIGHUP)
    rest = list(chunks)
    assert rest and rest[-1].choices[0].finish_reason in ("stop", "length")  # to its end
    assert gw.popen is not None and gw.popen.poll() is None  # still running
    assert httpx.get(f"{base}/readyz", timeout=10).status_code == 200
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "again"}], max_tokens=2)
    assert again.choices[0].finish_reason in ("stop", "length")
    wait_for(lambda: "SIGHUP" in gw.output(None), timeout=20, what="the SIGHUP line")
    assert "does not reload" in gw.output(None)


def test_sighup_leaves_a_gateway_serving(sim_factory: SimFactory, procs: list[Proc]) -> None:
    _, sim = sim_factory("--time-scale", "1")
    gw, base = gateway_proc(upstreams=[sim])
    procs.append(gw.start())
    _hup_mid_stream(gw, base)


def test_sighup_leaves_the_workers_serving(
        sim_factory: SimFactory, redis_url: str, procs: list[Proc]) -> None:
    _, sim = sim_factory("--time-scale", "1")
    gw, base = gateway_proc(upstreams=[sim], args=["--workers", "2"],
                            env={"KVGATE_REDIS_URL": redis_url})
    procs.append(gw.start())
    _hup_mid_stream(gw, base)
    assert "starting it again" not in gw.output(None)  # no worker was lost
