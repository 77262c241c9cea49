"""vLLM's ``GET /tokenizer_info`` at both edges: behind Envoy it was the picker's 404 ("kvgate
serves ...") though the HTTP edge serves it; the picker now answers it as the HTTP edge does
(the replica's own answer, an unknown model's 404, another method's 405). A real picker
behind a real Envoy and a real `kvgate serve`, one simulated replica, httpx."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support.edges import EdgeBases, running_edges
from tests.support.procs import sim_proc

MODEL = "sim-model"


@pytest.fixture(scope="module")
def edges() -> Iterator[dict[str, EdgeBases]]:
    sim, url = sim_proc(model=MODEL)
    with sim, running_edges(upstreams=[url]) as started:
        yield started


@pytest.mark.parametrize("edge", ["http", "envoy"])
def test_the_replicas_answer(edges: dict[str, EdgeBases], edge: str) -> None:
    base = edges[edge].base
    for params in ({}, {"model": MODEL}):
        answer = httpx.get(f"{base}/tokenizer_info", params=params, timeout=30,
                           headers={"x-request-id": "tok-7"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["name_or_path"] == MODEL  # the replica's own answer
        assert answer.json()["tokenizer_class"] == "SimTokenizer"
        assert answer.headers["x-request-id"].startswith("tok-7")
        assert answer.headers["x-kvgate-replica"].startswith("default/")


@pytest.mark.parametrize("edge", ["http", "envoy"])
def test_refusals_as_at_the_http_edge(edges: dict[str, EdgeBases], edge: str) -> None:
    base = edges[edge].base
    unknown = httpx.get(f"{base}/tokenizer_info", params={"model": "nope"}, timeout=30)
    assert unknown.status_code == 404, unknown.text
    assert unknown.json()["error"]["type"] == "NotFoundError"
    posted = httpx.post(f"{base}/tokenizer_info", json={}, timeout=30)
    assert posted.status_code == 405, posted.text
    assert posted.headers["allow"] == "GET, HEAD"
