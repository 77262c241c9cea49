"""`server.workers 2` under the faults an operator meets: a worker killed (OOM killer,
`kill -9`) soon after it started is restarted, not taken for a failed start that stops the
whole gateway; a worker that does fail at start still stops them all; on SIGTERM the streams
in flight finish while a new connection is refused at once (it was left in the listen backlog
of the supervisor's copy of the socket until the last worker had drained)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx
import openai
import pytest

from gateway.config import KvgateConfig, load_config
from gateway.workers import run_workers
from tests.support.gateway import GatewayProc, gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc

pytestmark = pytest.mark.slow

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]


def _workers(redis_url: str, sim: str, **server: Any) -> tuple[GatewayProc, str]:
    config = {"pools": {"p": {"replicas": [sim], "served_model": MODEL}},
              "models": {MODEL: {"default": "p"}}, "server": {"workers": 2, **server}}
    return gateway_proc(config=config, env={"KVGATE_REDIS_URL": redis_url})


def _children(proc: Proc) -> list[int]:
    assert proc.popen is not None
    out = subprocess.run(["pgrep", "-P", str(proc.popen.pid)], capture_output=True, text=True)
    return [int(pid) for pid in out.stdout.split()]


def _both_serving(base: str) -> None:
    """Wait until each worker has answered a /readyz (new connections reach both)."""
    members: set[str] = set()

    def both() -> bool:
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
            members.add(c.get(f"{base}/readyz", timeout=5).json()["sync"]["member"])
        return len(members) == 2

    wait_for(both, what="both workers serving")


def _refused(port: int) -> bool:
    """A connection to the port is refused (an accepted one is closed at once: not yet)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _client(base: str) -> tuple[openai.OpenAI, httpx.Client]:
    """A client opening a new connection per request (the kernel spreads them over workers)."""
    fresh = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
    # the SDK annotates http_client as httpx2.Client but also takes an httpx.Client
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30,
                         http_client=fresh), fresh  # type: ignore[arg-type]


def test_a_worker_killed_soon_after_its_start_is_restarted(
    redis_url: str, sim_factory: SimFactory
) -> None:
    _, sim = sim_factory()
    gw, base = _workers(redis_url, sim)
    with gw:
        _both_serving(base)
        first, second = _children(gw)
        os.kill(first, signal.SIGKILL)  # a second or two after it started serving
        wait_for(lambda: len(set(_children(gw)) - {first}) == 2, timeout=20,
                 what="the killed worker started again")
        assert gw.popen is not None and gw.popen.poll() is None, gw.output()
        assert "failed to start" not in gw.output()
        client, fresh = _client(base)
        with fresh:
            for _ in range(6):
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert second in _children(gw)


def test_a_worker_that_fails_at_start_stops_the_gateway(capfd: pytest.CaptureFixture[str]) -> None:
    """Each worker's start fails (its server returns before it serves): the supervisor stops
    them all and exits 1, not starting them again forever. (What made a real worker fail at
    start -- discovery outside a cluster without an API server -- `kvgate serve` now refuses
    before it forks: tests/integration/test_first_minutes.py.)"""
    cfg = load_config(None, environ={}, overrides={
        "pools": {"p": {"replicas": ["http://127.0.0.1:9"], "served_model": MODEL}},
        "models": {MODEL: {"default": "p"}}, "server": {"workers": 2},
        "redis_url": "redis://127.0.0.1:9"})
    def failing(_cfg: KvgateConfig, _sockets: list[socket.socket],
                _on_started: Callable[[], None]) -> int:
        return 3  # never called on_started: a failed start

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    assert run_workers(cfg, [sock], failing) == 1
    err = capfd.readouterr().err
    assert "worker 0 failed to start (exit 3)" in err or "worker 1 failed to start (exit 3)" in err
    assert "Traceback" not in err


def test_sigterm_finishes_streams_and_refuses_new_connections_at_once(
    sim_factory: SimFactory,
) -> None:
    _, sim = sim_factory()
    redis, redis_url = redis_proc()
    gw, base = _workers(redis_url, sim, shutdown_grace_s=30)
    with redis, gw:
        client, fresh = _client(base)
        started: list[int] = []
        finished: list[str | None] = []

        def stream() -> None:  # ~600 tokens: a few seconds at the simulator's pace
            chunks = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a long story"}],
                max_tokens=600, stream=True, extra_body={"ignore_eos": True})
            for i, chunk in enumerate(chunks):
                if i == 0:
                    started.append(i)
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished.append(chunk.choices[0].finish_reason)

        streams = [threading.Thread(target=stream) for _ in range(2)]
        for t in streams:
            t.start()
        wait_for(lambda: len(started) == 2, what="both streams under way")
        workers = _children(gw)
        gw.signal(signal.SIGTERM)
        port = int(base.rsplit(":", 1)[1])
        # refused once the workers have closed their listening sockets (before: a connection
        # waited in the supervisor's backlog for the drain, and timed out or was reset then)
        wait_for(partial(_refused, port), timeout=20, what="a new connection refused")
        during_drain = list(finished)  # the streams went on past the refusal
        assert gw.popen is not None
        assert gw.popen.wait(40) == 0, gw.output()
        for t in streams:
            t.join(30)
        fresh.close()
        assert finished == ["length", "length"]
        assert during_drain == [], "the refusal waited for the drain"
        assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}")]



def test_a_second_signal_stops_the_workers_without_waiting_for_the_grace(
    sim_factory: SimFactory,
) -> None:
    """A second Ctrl-C stops a gateway with workers at once, as it stops a one-process one.
    Before, the supervisor passed every signal on as SIGTERM, which a draining worker ignores:
    the gateway waited the whole grace period (here 600 s) for a stream that went on."""
    _, sim = sim_factory("--time-scale", "0.1")  # ten times slower than the preset
    redis, redis_url = redis_proc()
    gw, base = _workers(redis_url, sim, shutdown_grace_s=600)
    with redis, gw:
        client, fresh = _client(base)
        started = threading.Event()
        ended: list[BaseException | None] = []

        def stream() -> None:  # thousands of tokens: minutes at this simulator's pace
            try:
                chunks = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "an endless story"}],
                    max_tokens=4000, stream=True, extra_body={"ignore_eos": True})
                for _ in chunks:
                    started.set()
                ended.append(None)
            except Exception as exc:  # the stream is cut: the client must see an error
                ended.append(exc)

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30), gw.output()
        gw.signal(signal.SIGINT)
        # the workers are draining (their listening sockets closed): the first signal was
        # taken, so the next is a second one (two sent before it is taken make one)
        wait_for(partial(_refused, int(base.rsplit(":", 1)[1])), timeout=20,
                 what="the workers draining")
        assert gw.popen is not None and gw.popen.poll() is None  # the stream holds the drain
        gw.signal(signal.SIGINT)
        assert gw.popen.wait(60) == 0, gw.output()  # not the 600 s grace
        t.join(30)
        fresh.close()
        assert "second signal" in gw.output()
        assert len(ended) == 1 and ended[0] is not None  # cut, never read as a whole answer
