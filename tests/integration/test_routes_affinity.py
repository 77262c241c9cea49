"""How the new routes pick among a pool's replicas: an Anthropic conversation (system prompt
and turns) follows its cached prefix as a chat does (`prefix-hit` on the replica that served
its first turn, count_tokens included), and rerank, which has no prefix to pin, goes by load
alone (`least-cost`: no replica holds any of it). A real gateway (the default `cache_aware`
policy) before two simulated replicas."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.gateway import gateway_proc, inflight, wait_for
from tests.support.procs import Proc, start_sims

MODEL = "sim-model"
SYSTEM = "You are a meticulous reviewer of infrastructure change requests. " * 12


STACK: list[Proc] = []  # the module's simulators (the last test stops one)


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    procs: list[Proc] = []
    try:
        sims, urls = start_sims(procs, 2, "--time-scale", "50", model=MODEL)
        STACK.extend(sims)
        gw, url = gateway_proc(config={"pools": {"p": {"served_model": MODEL,
                                                       "replicas": urls}}})
        procs.append(gw.start())
        yield url
    finally:
        for p in reversed(procs):
            p.stop()
        STACK.clear()


def _post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    answer = httpx.post(f"{base}{path}", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer


def test_a_conversation_follows_its_prefix(base: str) -> None:
    turns: list[dict[str, Any]] = [{"role": "user", "content": "Review change 1."}]
    first = _post(base, "/v1/messages", {"model": MODEL, "max_tokens": 3, "system": SYSTEM,
                                         "messages": turns})
    home = first.headers["x-kvgate-replica"]
    for n in range(2, 5):
        turns += [{"role": "assistant", "content": "ok"},
                  {"role": "user", "content": f"Review change {n}."}]
        body = {"model": MODEL, "system": SYSTEM, "messages": turns}
        count = _post(base, "/v1/messages/count_tokens", body)
        answer = _post(base, "/v1/messages", {**body, "max_tokens": 3})
        for got in (count, answer):
            assert got.headers["x-kvgate-replica"] == home
            assert got.headers["x-kvgate-route"] == "prefix-hit"
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_rerank_is_not_pinned_to_a_prefix(base: str) -> None:
    body = {"model": MODEL, "query": SYSTEM, "documents": ["a", "b"]}
    routes = {_post(base, "/v1/rerank", body).headers["x-kvgate-route"] for _ in range(3)}
    assert routes == {"least-cost"}


def test_a_replica_gone_is_retried_on_the_other_before_any_byte(base: str) -> None:
    """(last in the module: it stops a replica) Nothing listens at one replica: each route
    is answered by the other, the failed try retried before any byte reached the client."""
    STACK[0].stop()
    turns = [{"role": "user", "content": "Review change 9."}]
    for _ in range(4):
        _post(base, "/v1/messages", {"model": MODEL, "max_tokens": 2, "system": SYSTEM,
                                     "messages": turns})
        _post(base, "/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"]})
        _post(base, "/tokenize", {"model": MODEL, "prompt": "a b"})
    wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")
