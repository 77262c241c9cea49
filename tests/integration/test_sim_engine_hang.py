"""`kvgate sim`'s `engine_hang` fault: the engine takes no step (no token for any request, its
counters frozen, its requests still counted running), `/health` and `/metrics` answer 200;
lifted, the held request finishes. A stuck engine reads no abort: a client that leaves
meanwhile is aborted once it steps again."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import httpx
import openai

from tests.support.gateway import wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
SimFactory = Callable[..., tuple[Proc, str]]


def stats(url: str) -> dict[str, float]:
    out: dict[str, float] = httpx.get(f"{url}/sim/stats").json()
    return out


def engine(url: str) -> dict[str, float]:
    now = stats(url)
    return {k: now[k] for k in ("running", "waiting", "generation_tokens", "aborted")}


def gauges(url: str) -> dict[str, float]:
    page = httpx.get(f"{url}/metrics")
    assert page.status_code == 200
    out = {}
    for line in page.text.splitlines():
        for name in ("vllm:num_requests_running", "vllm:generation_tokens_total"):
            if line.startswith(name + "{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_hung_engine_makes_no_token_and_answers_health_and_metrics(
    sim_factory: SimFactory,
) -> None:
    # ~30 tokens a second: 150 take ~5 s, so the hang comes long before the answer ends
    _, url = sim_factory("--time-scale", "0.2")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    answers: list[int] = []

    def long_one() -> None:
        done = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=150,
            extra_body={"ignore_eos": True})
        assert done.usage is not None
        answers.append(done.usage.completion_tokens)

    asker = threading.Thread(target=long_one)
    asker.start()
    wait_for(lambda: engine(url)["generation_tokens"] >= 5, timeout=30, what="5 tokens made")
    httpx.post(f"{url}/sim/faults", json={"engine_hang": True}).raise_for_status()
    frozen = gauges(url)
    time.sleep(1.5)
    assert gauges(url) == frozen  # no token, the request still running
    assert frozen["vllm:num_requests_running"] == 1
    assert httpx.get(f"{url}/health").status_code == 200
    assert not answers
    httpx.post(f"{url}/sim/faults", json={"engine_hang": False}).raise_for_status()
    asker.join(30)
    assert answers == [150]  # it went on from where it stopped


def test_an_abort_waits_for_the_engine_to_step_again(sim_factory: SimFactory) -> None:
    _, url = sim_factory("--engine-hang")
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                       "max_tokens": 4}).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                       b"application/json\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        wait_for(lambda: stats(url)["in_flight"] == 1, timeout=30, what="the request received")
    # the client left: the sim sees it (its handler gone) but the stuck engine applies no abort
    wait_for(lambda: stats(url)["in_flight"] == 0, timeout=30, what="the client's leaving seen")
    assert engine(url)["waiting"] + engine(url)["running"] == 1  # still there: not aborted
    assert engine(url)["aborted"] == 0
    httpx.post(f"{url}/sim/faults", json={"engine_hang": False}).raise_for_status()
    wait_for(lambda: engine(url)["aborted"] >= 1, timeout=30, what="the abort applied")
    assert engine(url) == {"running": 0, "waiting": 0, "generation_tokens": 0, "aborted": 1}
